"""`forge stage-config ENV_FILE DIR`: copy root-only settings where the service's own user can read them.

deploy/forge.service runs forge as a transient user (DynamicUser=yes, PrivateUsers=yes), and the operator keeps
/etc/forge/forge.env and the tenant file it names root's alone (0600 root:root: they hold keys). systemd reads
EnvironmentFile= as root at start, but forge reads both files itself, the tenant file at start and both again on
`systemctl reload`, as that user. So the unit runs this command with full privileges (a `+` ExecStartPre= and
ExecReload=) before forge reads them: it copies ENV_FILE to DIR/forge.env and the tenant file its
FORGE_API_KEYS_FILE names to DIR/keys.toml, rewriting that line to the copy's path, each file 0400 and owned
by DIR's owner (the unit's RuntimeDirectory=, /run/forge, which systemd gives to the transient user). forge
then reads only the copies (FORGE_ENV_FILE=/run/forge/forge.env), and no other user can read either.

Each copy is written to a new file and renamed into place, so that forge never reads half a file and a link
planted in DIR is replaced, never followed. A missing ENV_FILE stages an empty one (a reload picks up a file
created later); a tenant file that is named but cannot be read, or an ENV_FILE that is not KEY=VALUE lines,
fails the command with one line (the start or the reload fails; a running daemon keeps its settings).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

ENV_NAME, KEYS_NAME = "forge.env", "keys.toml"
MODE = 0o400
_KEYS_LINE = re.compile(r"^\s*(export\s+)?FORGE_API_KEYS_FILE\s*=")


class StageError(ValueError):
    """The settings cannot be staged; one line saying why."""


def stage(env_file: Path, dest: Path) -> list[Path]:
    """Copy `env_file` and the tenant file it names into `dest` (see the module's docstring); the paths written."""
    from actors.ops.reload import ReloadError, read_env_file

    try:
        owner = dest.stat()
    except OSError as exc:
        raise StageError(f"{dest}: {exc.strerror or exc}") from None
    text = ""
    if env_file.exists():
        try:
            keys_file = read_env_file(str(env_file)).get("FORGE_API_KEYS_FILE") or None
            text = env_file.read_text(encoding="utf-8")
        except (ReloadError, OSError) as exc:
            raise StageError(str(exc)) from None
    else:
        keys_file = None
    written = []
    if keys_file is not None:
        try:
            keys = Path(keys_file).read_bytes()
        except OSError as exc:
            raise StageError(f"FORGE_API_KEYS_FILE {keys_file}: {exc.strerror or exc}") from None
        written.append(_write(dest / KEYS_NAME, keys, owner))
        text = "".join(f"FORGE_API_KEYS_FILE={dest / KEYS_NAME}\n" if _KEYS_LINE.match(line) else line
                       for line in text.splitlines(keepends=True))
    else:
        (dest / KEYS_NAME).unlink(missing_ok=True)          # a tenant file no longer named
    written.append(_write(dest / ENV_NAME, text.encode("utf-8"), owner))
    return written


def _write(path: Path, data: bytes, owner: os.stat_result) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, MODE)
            if (owner.st_uid, owner.st_gid) != (os.geteuid(), os.getegid()):
                os.fchown(fd, owner.st_uid, owner.st_gid)
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
