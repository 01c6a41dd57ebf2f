"""The checks of text values beyond the plain ASCII names a config usually holds: bytes that are not UTF-8, and a
run.name that is not one folder name (accumulation/config/config.py). Imported only for such a value."""

import os

from accumulation.config.errors import ConfigError

# The longest file name Linux file systems accept, in bytes (NAME_MAX).
NAME_MAX_BYTES = 255


def refuse_non_utf8(key: str, value: str) -> None:
    """Lone surrogates: a command-line argument's bytes that are not UTF-8 arrive so (os.fsdecode). The run's
    config.toml, a UTF-8 file, cannot record them, so the run could never be repeated from it."""
    if not any("\ud800" <= character <= "\udfff" for character in value):
        return
    shown = os.fsencode(value).decode("utf-8", errors="backslashreplace")
    raise ConfigError(
        f"{key}: {shown!r} holds bytes that are not UTF-8, which the run's config.toml cannot record; use a "
        f"UTF-8 name (for a file or folder: rename it, or link to it under a UTF-8 name)"
    )


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot be a run directory's name, or None. It is joined to run.out_dir, so it must be one
    path component: a "/" or ".." would put the run elsewhere (an absolute name replaces out_dir whole), and
    "." would be out_dir itself."""
    if name in ("", ".", ".."):
        return "choose a name such as my-run"
    if "/" in name:
        return "it holds a path separator; use one name, and run.out_dir for the folder"
    if any(ord(character) < 32 or ord(character) == 127 for character in name):
        return "it holds a control character (a newline, a tab); use printable characters"
    if len(os.fsencode(name)) > NAME_MAX_BYTES:
        return f"{len(os.fsencode(name))} bytes, more than the {NAME_MAX_BYTES} a file name may have"
    return None
