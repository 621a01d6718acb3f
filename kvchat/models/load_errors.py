"""How a failed model load reads to a user: a missing path, an unreachable hub, a bad file."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvchat.errors import HubUnreachable, KvchatError, ModelError, ModelPathNotFound
from kvchat.models.embedded import EMBEDDED_NAME

if TYPE_CHECKING:
    from kvchat.models.loading import ModelSource


@contextlib.contextmanager
def load_errors(source: ModelSource) -> Iterator[None]:
    """Turn transformers' and the hub client's exceptions into one paragraph for the user."""
    try:
        yield
    except KvchatError:
        raise
    except OSError as error:
        if not source.is_local:
            raise HubUnreachable(_hub_message(source.location, _first_line(error))) from error
        raise ModelPathNotFound(
            f"Could not load {source.description} from {source.location}: {_first_line(error)}"
        ) from error
    except ValueError as error:
        # transformers' way of saying a config or checkpoint is not one it can read.
        raise ModelError(
            f"transformers cannot load {source.description} ({source.location}): "
            f"{_first_line(error)}"
        ) from error
    except Exception as error:
        # The hub client's HTTP and connection errors do not all derive from OSError.
        if not source.is_local and _is_hub_error(error):
            raise HubUnreachable(_hub_message(source.location, _first_line(error))) from error
        # anything else transformers raises while reading a model: one paragraph, not a trace
        raise ModelError(
            f"transformers could not load {source.description} ({source.location}): "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from error


def _hub_message(repo_id: str, detail: str) -> str:
    return (
        f"Could not fetch {repo_id!r} from the Hugging Face Hub: the hub is unreachable from "
        f"here, or no such model exists ({detail}). There is no local file or folder by that "
        "name either. To run offline, pass a local model folder or a .gguf file with --model, "
        f"or leave --model out to use the embedded {EMBEDDED_NAME}."
    )


def _is_hub_error(error: Exception) -> bool:
    module = type(error).__module__
    return module.startswith(("huggingface_hub", "httpx", "httpcore", "requests", "urllib3"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
