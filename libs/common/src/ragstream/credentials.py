"""Encryption of connection credentials at rest, with key rotation.

A connection's credentials (a JSON object of strings: app id and secret, API token, ...) are stored
as one Fernet token: AES-128-CBC plus an HMAC-SHA256 over it, so a changed byte is detected rather
than decrypted into garbage. ``MultiFernet`` encrypts with the first configured key and tries every
key to decrypt, which is what key rotation needs: put the new key first, keep the old one until
``rotate`` has re-encrypted every token, then drop it.

Plaintext values only ever live in ``SecretStr``: a repr, a log line or a traceback shows
``'**********'``, and only a connector that calls ``get_secret_value()`` sees the real string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pydantic import SecretStr

from ragstream.core.errors import ConfigurationError
from ragstream.settings import Settings

if TYPE_CHECKING:
    from cryptography.fernet import MultiFernet

__all__ = ["CredentialCipher", "CredentialKeyMissing", "CredentialsUnreadable"]


class CredentialKeyMissing(ConfigurationError, RuntimeError):
    """Credentials were given or stored, but ``RAGSTREAM_CREDENTIAL_KEYS`` is not set."""

    def __init__(self) -> None:
        super().__init__(
            "connection credentials need an encryption key: set RAGSTREAM_CREDENTIAL_KEYS to a Fernet key "
            '(python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())")'
        )


class CredentialsUnreadable(ConfigurationError, ValueError):
    """A stored token was altered, or none of the configured keys encrypted it."""


class CredentialCipher:
    """Encrypts, decrypts and re-encrypts credential objects; holds no plaintext itself."""

    def __init__(self, keys: Sequence[SecretStr]) -> None:
        """``keys`` in priority order: the first encrypts. An empty list is allowed so that a deployment
        without credentials needs no key; using the cipher then raises ``CredentialKeyMissing``.
        cryptography is imported only when there are keys: a folder sync needs none."""
        if not keys:
            self._fernet: MultiFernet | None = None
            return
        from cryptography.fernet import Fernet, MultiFernet

        fernets: list[Fernet] = []
        for number, key in enumerate(keys, start=1):
            try:
                fernets.append(Fernet(key.get_secret_value().encode()))
            except ValueError:
                # The message names the position only: the key itself must not reach a log.
                raise ValueError(
                    f"RAGSTREAM_CREDENTIAL_KEYS: key {number} is not a Fernet key (32 url-safe base64-encoded bytes)"
                ) from None
        self._fernet = MultiFernet(fernets)

    @classmethod
    def from_settings(cls, settings: Settings) -> CredentialCipher:
        raw = settings.credential_keys.get_secret_value() if settings.credential_keys else ""
        return cls([SecretStr(key.strip()) for key in raw.split(",") if key.strip()])

    def _require(self) -> MultiFernet:
        if self._fernet is None:
            raise CredentialKeyMissing()
        return self._fernet

    def encrypt(self, credentials: Mapping[str, SecretStr]) -> bytes:
        """One token for the whole object, with the primary key."""
        plain = json.dumps({name: value.get_secret_value() for name, value in credentials.items()})
        return self._require().encrypt(plain.encode())

    def decrypt(self, token: bytes) -> dict[str, SecretStr]:
        """The credential object; raises ``CredentialsUnreadable`` for a tampered or foreign token."""
        fernet = self._require()
        from cryptography.fernet import InvalidToken

        try:
            plain = fernet.decrypt(token)
        except InvalidToken as error:
            raise CredentialsUnreadable("stored credentials cannot be decrypted with the configured keys") from error
        values = json.loads(plain)
        return {str(name): SecretStr(str(value)) for name, value in values.items()}

    def rotate(self, token: bytes) -> bytes:
        """The same credentials encrypted with the primary key (whichever configured key made ``token``)."""
        fernet = self._require()
        from cryptography.fernet import InvalidToken

        try:
            return fernet.rotate(token)
        except InvalidToken as error:
            raise CredentialsUnreadable("stored credentials cannot be decrypted with the configured keys") from error
