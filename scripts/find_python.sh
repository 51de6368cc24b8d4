# Sourced by the GPU scripts: sets PYTHON to the first interpreter with CUDA (the project's
# .venv, then python3), else the first with torch, unless PYTHON is set already.
if [ -z "${PYTHON:-}" ]; then  # the first with CUDA; else the first with torch
    for candidate in .venv/bin/python python3; do
        command -v "$candidate" >/dev/null || continue
        if "$candidate" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
            2>/dev/null; then
            PYTHON=$candidate
            break
        fi
        [ -z "${PYTHON:-}" ] && "$candidate" -c "import torch" 2>/dev/null && PYTHON=$candidate
    done
    PYTHON=${PYTHON:-python3}
fi
