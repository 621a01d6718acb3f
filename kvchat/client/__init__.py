"""The thin side of a resident `kvchat serve`: an HTTP client that imports neither torch nor
transformers, and the discovery of a server holding a sessions dir.

- `http`: Client (generate, streaming replies, cache stats and tree, sessions, save)
- `attach`: which server a command talks to (--connect, or the sessions dir's lock file)
"""

from kvchat.client.attach import Attachment, attachment
from kvchat.client.http import Client, ReplyStream, ServerError, ServerGone

__all__ = ["Attachment", "Client", "ReplyStream", "ServerError", "ServerGone", "attachment"]
