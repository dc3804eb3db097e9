"""Errors raised by `structured/`.

`ConstraintError` is the user's fault: the ingress renders it as HTTP 400 with the OpenAI error
envelope `{"error": {"message", "type": "invalid_request_error", "param", "code": 400}}`.
`InvalidTokenError` is the engine's fault (it advanced a guide with a token the mask forbade): a 500.
"""

from __future__ import annotations


class ConstraintError(Exception):
    """A constraint the server will not enforce: invalid, unsupported, unsatisfiable or too costly.

    `param` names the request field to blame ("response_format", "structured_outputs.regex", ...)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = "response_format") -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict:
        """The OpenAI error envelope's inner object."""
        return {"message": self.message, "type": self.error_type, "param": self.param,
                "code": self.status_code}


class InvalidTokenError(ValueError):
    """A guide was advanced with a token its current state does not allow."""
