"""One exception family; the CLI turns it into a one-line error and a non-zero exit."""


class LoopcastError(Exception):
    """Base class: a problem with the user's input, named in the message."""


class ConfigError(LoopcastError):
    """A model configuration loopcast cannot handle (unknown type, unsupported feature)."""


class CheckpointError(LoopcastError):
    """A checkpoint directory that is missing files, tensors or has wrong shapes."""


class ArtifactError(LoopcastError):
    """An exported artifact that is missing, corrupt or of another schema version."""


class ExportError(LoopcastError):
    """Export options that cannot be honoured (width, depth, length, output directory)."""


class RequestError(LoopcastError):
    """A generation request that cannot be served (prompt, ids, lengths).

    ``parameter`` names the option at fault as the library spells it (``num_draft_tokens``), so
    that a front end can say it its own way (the CLI's ``--num-draft-tokens``, cli/flags.py)."""

    def __init__(self, *args: object, parameter: str | None = None) -> None:
        super().__init__(*args)
        self.parameter = parameter
