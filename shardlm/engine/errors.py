"""What a request's caller may get instead of its output."""


class EngineDeadError(RuntimeError):
    """The engine core (or the replica serving the request) is gone; requests in flight cannot
    finish. Retriable: the server answers 503 with Retry-After."""


class RequestFailedError(RuntimeError):
    """This request failed on its own (an adapter that could not be read); the engine goes on."""
