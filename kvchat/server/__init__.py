"""`kvchat serve`: the HTTP front end over the engine (FastAPI on uvicorn).

- `app`: create_app, the lifespan; `state`: what handlers share (`app.state.server`)
- `worker`: the engine thread, the only code that touches the scheduler, runtime and cache;
  `handle`: one request as the event loop sees it
- `native`, `openai`, `cache_api`, `pins_api`, `sessions_api`, `moves_api`: one router per
  API family (`pinning`: pins as tenants own them)
- `auth`: access token, API keys -> tenants and their cache namespaces (the AuthGate middleware)
- `schemas`: request bodies; `prepare`: body -> engine request (template, sampling, sessions)
- `errors`: the JSON error shape; `limits`: the body limit; `sse`: delivering replies
- `serving`: uvicorn with a graceful shutdown, and running the app in the background
"""

from kvchat.server.app import create_app
from kvchat.server.auth import Auth, AuthError, startup_auth
from kvchat.server.serving import Server, bind_warning, is_loopback, log_to_stderr, serving

__all__ = ["Auth", "AuthError", "Server", "bind_warning", "create_app", "is_loopback",
           "log_to_stderr", "serving", "startup_auth"]
