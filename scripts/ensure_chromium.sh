#!/usr/bin/env bash
# Headless Chromium for the browser check of the built book (tests/book/test_browser.py).
# Installs Debian/Ubuntu's `chromium` when it is missing and this user can (root, or sudo
# without a password); otherwise stops with the one command to run.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    SUDO=none
fi
if [ "$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then
    echo "make test: installing headless Chromium (apt-get install chromium) for the browser check"
    $SUDO apt-get install -y --no-install-recommends chromium >/dev/null \
        || { $SUDO apt-get update >/dev/null \
             && $SUDO apt-get install -y --no-install-recommends chromium >/dev/null; }
    exit 0
fi
echo "make test needs headless Chromium for the browser check of the built book. Run:" >&2
echo "    sudo apt-get install chromium" >&2
exit 1
