"""The error every model-loading path raises, in a module of its own so that ``loading`` and
``quantization`` (which ``loading`` imports) both import it without an import circle."""


class ModelLoadError(RuntimeError):
    """The model named in ``model.name`` could not be found or loaded; the message says why."""
