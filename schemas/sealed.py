"""Sealed values: JSON values encrypted at rest, with keys from configuration.

A sealed value stands in for a JSON value as ``{"$sealed": "<key id>:<base64 of nonce + ciphertext>"}``:
AES-256-GCM (the ``cryptography`` package) over the value's JSON, with a fresh 96-bit nonce per value
and, as associated data, where the value belongs (task, step, field). The associated data makes a sealed
value undecryptable anywhere else: copied into another task or field it fails authentication instead of
passing for that task's data.

Keys come from ``STEPSTREAM_ENCRYPTION_KEYS="kid1:base64key,kid0:oldkey"``. The first key seals; every
key listed unseals what was sealed with it, so rotation is: put a new key first, keep the old ones for as
long as the log holds values sealed with them. The setting is a secret: it is never logged or printed.

Envelope encryption: a task's values are sealed with its own data key (``TaskKey``, AES-256-SIV), and
only that data key is encrypted with the configured master keys (``Keyring.wrap``). Deleting a task's
wrapped data key (crypto-shredding) makes every copy of its sealed values, in every topic, store or backup,
unreadable at once, while the log itself is never rewritten; rotating a master key rewraps the data keys
and leaves the sealed values alone. A value sealed with a task key is ``{"$sealed": "@task:<base64>"}``
("@" cannot start a master key id). AES-SIV is deterministic: the same value sealed again for the same
task and place gives the same bytes, so a repeated submission keeps the digest that tells it from a
contradiction; it reveals no more than "these two values of one task's field are equal".
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESSIV
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

SEALED = "$sealed"
TASK_KEY_ID = "@task"
"""The key id of values sealed with their task's own data key."""
_NONCE_BYTES = 12
_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


class SealingError(Exception):
    """A key is malformed or missing, or a sealed value does not open with the key it names."""


def is_sealed(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(SEALED), str)


def sealed_with_task_key(value: Any) -> bool:
    return is_sealed(value) and str(value[SEALED]).startswith(TASK_KEY_ID + ":")


class TaskKey:
    """One task's data key: seals and opens that task's values (AES-256-SIV, deterministic)."""

    SIZE = 64  # AES-SIV takes two AES-256 keys

    def __init__(self, key: bytes) -> None:
        if len(key) != self.SIZE:
            raise SealingError(f"a task data key is {self.SIZE} bytes, not {len(key)}")
        self.key = key
        self._cipher = AESSIV(key)

    @classmethod
    def generate(cls) -> TaskKey:
        return cls(AESSIV.generate_key(bit_length=cls.SIZE * 8))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskKey) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def seal(self, value: Any, where: tuple[str, ...]) -> dict[str, str]:
        """``value`` (any JSON value) sealed for ``where`` (task id first); the same bytes every time."""
        sealed = self._cipher.encrypt(orjson.dumps(value), [_associated(where)])
        return {SEALED: f"{TASK_KEY_ID}:{base64.b64encode(sealed).decode()}"}

    def unseal(self, envelope: dict[str, str], where: tuple[str, ...]) -> Any:
        _, _, encoded = envelope[SEALED].partition(":")
        try:
            return orjson.loads(self._cipher.decrypt(base64.b64decode(encoded, validate=True), [_associated(where)]))
        except (binascii.Error, InvalidTag, orjson.JSONDecodeError) as exc:
            raise SealingError(f"sealed value for {'/'.join(where)} does not open with its task's key") from exc


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

    def wrap(self, key: TaskKey, task_id: str) -> str:
        """``key`` encrypted with the current master key, bound to its task: ``kid:base64``."""
        return self.seal(base64.b64encode(key.key).decode(), (task_id, "data-key"))[SEALED]

    def unwrap(self, wrapped: str, task_id: str) -> TaskKey:
        """The data key ``wrapped`` holds; SealingError naming the master key id when it does not open."""
        return TaskKey(base64.b64decode(self.unseal({SEALED: wrapped}, (task_id, "data-key"))))

    @staticmethod
    def wrapped_with(wrapped: str) -> str:
        """The id of the master key that wrapped ``wrapped`` (rotation rewraps the others)."""
        return wrapped.partition(":")[0]

    def unseal(self, envelope: dict[str, str], where: tuple[str, ...]) -> Any:
        """The value sealed in ``envelope`` for ``where``; raises SealingError if it does not open."""
        kid, _, encoded = envelope[SEALED].partition(":")
        if kid == TASK_KEY_ID:
            raise SealingError(f"value for {'/'.join(where)} is sealed with its task's data key, not a master key")
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise SealingError(f"value sealed with key {kid!r}, which is not configured "
                               "(keep retired keys in STEPSTREAM_ENCRYPTION_KEYS while the log holds their data)")
        try:
            data = base64.b64decode(encoded, validate=True)
            return orjson.loads(cipher.decrypt(data[:_NONCE_BYTES], data[_NONCE_BYTES:], _associated(where)))
        except (binascii.Error, InvalidTag, orjson.JSONDecodeError) as exc:
            raise SealingError(f"sealed value for {'/'.join(where)} does not open with key {kid!r}") from exc


def input_place(task_id: str, name: str) -> tuple[str, ...]:
    """Where a task input's field is sealed for (the associated data binding it there)."""
    return (task_id, "input", name)


def output_place(task_id: str, step: str, name: str) -> tuple[str, ...]:
    """Where a step output's field is sealed for."""
    return (task_id, step, "output", name)


class OpenedInput(NamedTuple):
    """An agent request's input with its sealed values opened, and those values: what the agent must keep
    out of everything it records or returns (:mod:`agents.redaction`)."""

    data: dict[str, Any]
    values: list[Any]


def open_step_input(data: dict[str, Any], task_id: str, key_of: Callable[[], TaskKey | None]) -> OpenedInput:
    """An agent request's input (``{"task": input, "steps": {step: output}}``) with the values sealed with
    the task's key opened, each for the place it sits in, and the values opened. ``key_of`` is asked for the
    key once, at the first sealed value (a request holding none costs no lookup); SealingError when it has
    none (the task's data was erased) or the key does not open a value."""
    found: list[TaskKey | None] = []
    values: list[Any] = []

    def opened(value: Any, where: tuple[str, ...]) -> Any:
        if not sealed_with_task_key(value):
            return value
        if not found:
            found.append(key_of())
        key = found[0]
        if key is None:
            raise SealingError(f"task {task_id}: a sealed value at {'/'.join(where[1:])} and no data key "
                               "(the task's data was erased)")
        clear = key.unseal(value, where)
        values.append(clear)
        return clear

    def fields(part: Any, place: Callable[[str], tuple[str, ...]]) -> Any:
        if not isinstance(part, dict):
            return part
        return {name: opened(value, place(name)) for name, value in part.items()}

    def output_of(step: str) -> Callable[[str], tuple[str, ...]]:
        return lambda name: output_place(task_id, step, name)

    opened_data = dict(data)
    if "task" in data:
        opened_data["task"] = fields(data["task"], lambda name: input_place(task_id, name))
    steps = data.get("steps")
    if isinstance(steps, dict):
        opened_data["steps"] = {step: fields(output, output_of(step)) for step, output in steps.items()}
    return OpenedInput(opened_data, values)


def seal_fields(values: dict[str, Any], names: list[str], where: tuple[str, ...], key: TaskKey) -> dict[str, Any]:
    """``values`` with the named fields (``*``: all) sealed with ``key`` for ``where`` + the field's name."""
    chosen = set(values) if "*" in names else set(names)
    return {name: key.seal(value, (*where, name)) if name in chosen and not is_sealed(value) else value
            for name, value in values.items()}


def _associated(where: tuple[str, ...]) -> bytes:
    return "\x00".join(where).encode()


LOCAL_KEYS_FILE = "encryption-keys"


def configured_keys(home: Path, *, create: bool = False) -> str | None:
    """The master keys spec: ``STEPSTREAM_ENCRYPTION_KEYS``, else the development key of a local home
    (``<home>/encryption-keys``, readable by its owner only), which ``stepstream up`` makes once (``create``)
    so that a local system and the commands run beside it share one; None when neither exists. A
    deployment sets the variable; the file is for local systems."""
    configured = EncryptionSettings().encryption_keys.get_secret_value().strip()
    if configured:
        return configured
    path = home / LOCAL_KEYS_FILE
    if create and not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(f"local1:{Keyring.generate_key()}\n")
    if not path.exists():
        return None
    spec = path.read_text().strip()
    Keyring.parse(spec)  # a damaged file stops here, naming the entry, never repeating a key
    return spec


class EncryptionSettings(BaseSettings):
    """``STEPSTREAM_ENCRYPTION_KEYS``: the keys sealing sensitive fields (empty: none configured)."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_", frozen=True, extra="ignore")

    encryption_keys: SecretStr = Field(default=SecretStr(""),
                                       description="kid:base64key,...; the first seals, all unseal")

    def keyring(self) -> Keyring | None:
        spec = self.encryption_keys.get_secret_value()
        return Keyring.parse(spec) if spec.strip() else None
