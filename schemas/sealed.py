"""Sealed values: JSON values encrypted at rest, with keys from configuration.

A sealed value stands in for a JSON value as ``{"$sealed": "<key id>:<base64 of nonce + ciphertext>"}``:
AES-256-GCM (the ``cryptography`` package) over the value's JSON, with a fresh 96-bit nonce per value
and, as associated data, where the value belongs (task, step, field). The associated data makes a sealed
value undecryptable anywhere else: copied into another task or field it fails authentication instead of
passing for that task's data.

Keys come from ``STEPSTREAM_ENCRYPTION_KEYS="kid1:base64key,kid0:oldkey"``. The first key seals; every
key listed unseals what was sealed with it, so rotation is: put a new key first, keep the old ones for as
long as the log holds values sealed with them. The setting is a secret: it is never logged or printed.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

SEALED = "$sealed"
_NONCE_BYTES = 12
_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


class SealingError(Exception):
    """A key is malformed or missing, or a sealed value does not open with the key it names."""


def is_sealed(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(SEALED), str)


class Keyring:
    """The configured keys by id; the first one seals."""

    def __init__(self, keys: list[tuple[str, bytes]]) -> None:
        if not keys:
            raise SealingError("a keyring needs at least one key")
        self._ciphers: dict[str, AESGCM] = {}
        for kid, key in keys:
            if not _KEY_ID.match(kid):
                raise SealingError(f"key id {kid!r}: 1 to 32 letters, digits, '.', '_' or '-'")
            if kid in self._ciphers:
                raise SealingError(f"key id {kid!r} is listed twice")
            if len(key) != 32:
                raise SealingError(f"key {kid!r} is {len(key)} bytes: AES-256-GCM keys are 32 bytes")
            self._ciphers[kid] = AESGCM(key)
        self.current = keys[0][0]

    @classmethod
    def parse(cls, spec: str) -> Keyring:
        """``kid:base64key,kid:base64key``; the message of a malformed entry never repeats the key."""
        keys: list[tuple[str, bytes]] = []
        for position, entry in enumerate(filter(None, (e.strip() for e in spec.split(","))), start=1):
            kid, sep, encoded = entry.partition(":")
            if not sep:
                raise SealingError(f"key entry {position} is not kid:base64key")
            try:
                keys.append((kid.strip(), base64.b64decode(encoded.strip(), validate=True)))
            except binascii.Error:
                raise SealingError(f"key {kid.strip()!r} is not valid base64") from None
        return cls(keys)

    @staticmethod
    def generate_key() -> str:
        """A new random key, base64, for a ``kid:key`` entry."""
        return base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()

    def seal(self, value: Any, where: tuple[str, ...]) -> dict[str, str]:
        """Encrypt ``value`` (any JSON value) for the place ``where`` names, with the current key."""
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._ciphers[self.current].encrypt(nonce, orjson.dumps(value), _associated(where))
        return {SEALED: f"{self.current}:{base64.b64encode(nonce + sealed).decode()}"}

    def unseal(self, envelope: dict[str, str], where: tuple[str, ...]) -> Any:
        """The value sealed in ``envelope`` for ``where``; raises SealingError if it does not open."""
        kid, _, encoded = envelope[SEALED].partition(":")
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise SealingError(f"value sealed with key {kid!r}, which is not configured "
                               "(keep retired keys in STEPSTREAM_ENCRYPTION_KEYS while the log holds their data)")
        try:
            data = base64.b64decode(encoded, validate=True)
            return orjson.loads(cipher.decrypt(data[:_NONCE_BYTES], data[_NONCE_BYTES:], _associated(where)))
        except (binascii.Error, InvalidTag, orjson.JSONDecodeError) as exc:
            raise SealingError(f"sealed value for {'/'.join(where)} does not open with key {kid!r}") from exc


def _associated(where: tuple[str, ...]) -> bytes:
    return "\x00".join(where).encode()


class EncryptionSettings(BaseSettings):
    """``STEPSTREAM_ENCRYPTION_KEYS``: the keys sealing sensitive fields (empty: none configured)."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_", frozen=True, extra="ignore")

    encryption_keys: SecretStr = Field(default=SecretStr(""),
                                       description="kid:base64key,...; the first seals, all unseal")

    def keyring(self) -> Keyring | None:
        spec = self.encryption_keys.get_secret_value()
        return Keyring.parse(spec) if spec.strip() else None
