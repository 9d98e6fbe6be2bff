"""``${VAR}`` references in the routing file, expanded once when it is loaded.

Any string value may name environment variables: ``${NAME}`` (required: unset or empty
is an error) and ``${NAME:-default}`` (``default`` when unset or empty, as in the shell);
``$${`` is a literal ``${``. Every variable that is missing is reported, each with its
path in the file (``auth.api_keys.0: environment variable PDR_API_KEY is not set``),
together with the file's other mistakes (:func:`router.config.parse_config`). A value is
substituted as text, never parsed as YAML.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["ConfigPath", "env_problem", "expand_env", "require_env"]

# Where a value sits in the file: keys and list indexes from the top.
ConfigPath = tuple[object, ...]


def env_problem(name: str) -> str | None:
    """Why the environment variable ``name`` cannot be used, or None if it can."""
    value = os.environ.get(name)
    if value is None:
        return f"environment variable {name} is not set"
    if not value:
        return f"environment variable {name} is empty"
    return None


def require_env(name: str) -> str:
    problem = env_problem(name)
    if problem:
        raise ValueError(problem)
    return os.environ[name]


# ``$${`` (a literal ``${``), ``${NAME}``, ``${NAME:-default}``, or any other ``${``
# (a mistake: reported rather than kept as text). The default is literal text up to
# the first ``}``.
_ENV_REF = re.compile(
    r"(?P<escape>\$\$\{)"
    r"|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<has_default>:-(?P<default>[^}]*))?\}"
    r"|(?P<bad>\$\{[^}]*\}?)"
)


def expand_env(data: Any, path: ConfigPath, missing: list[tuple[ConfigPath, str]]) -> Any:
    """``data`` with ``${...}`` in its strings substituted; adds problems to ``missing``.

    An unusable variable is replaced by an empty string, so that the rest of the
    document can still be validated.
    """
    if isinstance(data, dict):
        return {k: expand_env(v, (*path, k), missing) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, (*path, i), missing) for i, v in enumerate(data)]
    if not isinstance(data, str) or "${" not in data:
        return data

    def substitute(m: re.Match[str]) -> str:
        if m["escape"]:
            return "${"
        if m["bad"]:
            # Not echoed under auth: the text may be part of an inline key.
            shown = "" if path[:1] == ("auth",) else f" {m['bad']!r}"
            missing.append(
                (
                    path,
                    f"malformed environment reference{shown} "
                    "(write ${NAME} or ${NAME:-default}; $${ for a literal ${)",
                )
            )
            return ""
        name: str = m["name"]
        value = os.environ.get(name)
        if value:
            return value
        if m["has_default"]:
            default: str = m["default"]
            return default
        missing.append((path, env_problem(name) or f"environment variable {name} is not set"))
        return ""

    return _ENV_REF.sub(substitute, data)
