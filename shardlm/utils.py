"""Small helpers used across the package."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
