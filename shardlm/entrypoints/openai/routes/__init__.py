"""The server's routes, one FastAPI router per area; server.build_app assembles them."""
