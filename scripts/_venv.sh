# Sourced by scripts/test and scripts/demo: make sure .venv exists with oncely installed.
# Usage: ensure_venv EXTRAS   (e.g. "dev,all" or "")
# Reinstalls only when pyproject.toml changed since the last install.

ensure_venv() {
    local extras="$1" root venv stamp want python
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$root/.venv"
    python="${ONCELY_BOOTSTRAP_PYTHON:-python3}"
    if ! command -v "$python" >/dev/null 2>&1; then
        echo "[setup] python3 is missing: installing it with apt-get" >&2
        apt-get update -qq && apt-get install -y -qq --no-upgrade python3 python3-venv >&2
    fi
    if [ ! -x "$venv/bin/python" ]; then
        echo "[setup] creating $venv" >&2
        if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
            # Debian's python3 ships venv separately.
            rm -rf "$venv"
            apt-get update -qq && apt-get install -y -qq --no-upgrade python3-venv >&2
            "$python" -m venv "$venv"
        fi
    fi
    want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16)-[$extras]"
    stamp="$venv/.oncely-installed"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "[setup] installing oncely${extras:+[$extras]} into $venv" >&2
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
        "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root${extras:+[$extras]}" >&2
        echo "$want" >"$stamp"
    fi
    export PATH="$venv/bin:$PATH"
    export ONCELY_PYTHON="$venv/bin/python"
}
