"""Credential encryption: round trip, tampering, key rotation in the store and the CLI, missing keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr

from ragstream.credentials import CredentialCipher, CredentialKeyMissing, CredentialsUnreadable
from ragstream.settings import Settings
from ragstream.storage.connections import ConnectionStore
from ragstream.storage.database import connect_pool
from tests.support.connections import private_database


def new_key() -> SecretStr:
    return SecretStr(Fernet.generate_key().decode())


def cipher(*keys: SecretStr) -> CredentialCipher:
    return CredentialCipher(list(keys))


SECRET = {"app_id": SecretStr("cli_a1b2"), "app_secret": SecretStr("s3cr3t-value")}


def plain(credentials: dict[str, SecretStr]) -> dict[str, str]:
    return {name: value.get_secret_value() for name, value in credentials.items()}


def test_round_trip_hides_values_in_repr() -> None:
    box = cipher(new_key())
    token = box.encrypt(SECRET)
    assert b"s3cr3t" not in token
    decrypted = box.decrypt(token)
    assert plain(decrypted) == plain(SECRET)
    assert "s3cr3t" not in repr(decrypted) and "s3cr3t" not in str(decrypted)


def test_a_tampered_or_foreign_token_is_rejected() -> None:
    box = cipher(new_key())
    with pytest.raises(CredentialsUnreadable):
        box.decrypt(cipher(new_key()).encrypt(SECRET))  # another key
    tampered = bytearray(box.encrypt(SECRET))
    tampered[40] = ord("A") if tampered[40] != ord("A") else ord("B")
    with pytest.raises(CredentialsUnreadable):
        box.decrypt(bytes(tampered))


def test_rotation_keeps_old_tokens_readable_and_moves_them_to_the_new_key() -> None:
    old, new = new_key(), new_key()
    token = cipher(old).encrypt(SECRET)
    both = cipher(new, old)
    assert plain(both.decrypt(token)) == plain(SECRET)
    rotated = both.rotate(token)
    assert plain(cipher(new).decrypt(rotated)) == plain(SECRET)
    with pytest.raises(CredentialsUnreadable):
        cipher(old).decrypt(rotated)


def test_no_key_is_a_clear_error_and_a_bad_key_is_not_echoed() -> None:
    with pytest.raises(CredentialKeyMissing, match="RAGSTREAM_CREDENTIAL_KEYS"):
        cipher().encrypt(SECRET)
    with pytest.raises(ValueError, match="key 2 is not a Fernet key") as error:
        cipher(new_key(), SecretStr("not-a-key-PLANTED"))
    assert "PLANTED" not in str(error.value)


def test_keys_come_comma_separated_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = new_key(), new_key()
    token = cipher(old).encrypt(SECRET)
    monkeypatch.setenv("RAGSTREAM_CREDENTIAL_KEYS", f"{new.get_secret_value()}, {old.get_secret_value()}")
    settings = Settings()
    assert old.get_secret_value() not in repr(settings)
    from_env = CredentialCipher.from_settings(settings)
    assert plain(cipher(new).decrypt(from_env.rotate(token))) == plain(SECRET)
    monkeypatch.delenv("RAGSTREAM_CREDENTIAL_KEYS")
    with pytest.raises(CredentialKeyMissing):
        CredentialCipher.from_settings(Settings()).decrypt(token)


@pytest.mark.integration
async def test_store_rotation_needs_only_the_new_key_afterwards(database_url: str) -> None:
    old, new = new_key(), new_key()
    async with private_database(database_url) as dsn:
        pool = await connect_pool(dsn)
        try:
            before = ConnectionStore(pool, cipher(old))
            first = await before.create("feishu", "wiki", credentials=SECRET)
            second = await before.create("yuque", "docs", credentials={"token": SecretStr("yq-token")})
            await before.create("web", "site")  # no credentials: nothing to rotate
            with pytest.raises(CredentialKeyMissing):
                await ConnectionStore(pool, cipher()).create("ima", "notes", credentials=SECRET)

            assert await ConnectionStore(pool, cipher(new, old)).rotate_credentials() == 2
            after = ConnectionStore(pool, cipher(new))
            assert plain(await after.credentials(first.id) or {}) == plain(SECRET)
            assert plain(await after.credentials(second.id) or {}) == {"token": "yq-token"}
            with pytest.raises(CredentialsUnreadable):
                await ConnectionStore(pool, cipher(old)).credentials(first.id)
            # A listing under the wrong key still answers: field names unknown, values never shown.
            listed = {c.id: c for c in await ConnectionStore(pool, cipher(old)).all()}
            assert listed[first.id].has_credentials and listed[first.id].credential_fields == ()
        finally:
            await pool.close()


@pytest.mark.integration
async def test_cli_rotates_and_explains_a_missing_key(database_url: str) -> None:
    old, new = new_key(), new_key()
    async with private_database(database_url) as dsn:
        pool = await connect_pool(dsn)
        try:
            made = await ConnectionStore(pool, cipher(old)).create("dingtalk", "kb", credentials=SECRET)
        finally:
            await pool.close()

        def ragstream(keys: str | None) -> subprocess.CompletedProcess[str]:
            env = {key: value for key, value in os.environ.items() if key != "RAGSTREAM_CREDENTIAL_KEYS"}
            env["DATABASE_URL"] = dsn
            if keys is not None:
                env["RAGSTREAM_CREDENTIAL_KEYS"] = keys
            return subprocess.run(
                [sys.executable, "-m", "ragstream.cli", "credentials", "rotate"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )

        missing = ragstream(None)
        assert missing.returncode == 1 and "RAGSTREAM_CREDENTIAL_KEYS" in missing.stderr
        rotated = ragstream(f"{new.get_secret_value()},{old.get_secret_value()}")
        assert rotated.returncode == 0, rotated.stderr
        assert rotated.stdout.strip() == "1 connection(s) re-encrypted with the primary key"

        pool = await connect_pool(dsn)
        try:
            assert plain(await ConnectionStore(pool, cipher(new)).credentials(made.id) or {}) == plain(SECRET)
        finally:
            await pool.close()
