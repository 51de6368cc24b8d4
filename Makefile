# Two commands on a fresh machine: `make book`, then `make test`. See README.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# On a CUDA machine torch's CUDA build pins the triton release it was built with; the
# constraints then leave triton to torch (see README, "GPU notes").
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_CUDA),1)
CONSTRAINTS := $(VENV)/constraints-cuda.txt
else
CONSTRAINTS := constraints.txt
endif

JB_FLAGS := -W -n --keep-going
TEST_OUT := _build/test

.PHONY: book test exercises notebooks lab clean distclean install

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	grep -v '^triton==' constraints.txt > $(VENV)/constraints-cuda.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		-c $(CONSTRAINTS) -e '.[book,docs,serve,test]'
	touch $@

# Builds the HTML book into _build/html, executing every page (cached between runs).
book: $(STAMP)
	$(BIN)/jupyter-book build . $(JB_FLAGS)
	@echo "Open _build/html/index.html"

# Unit, property, oracle, kernel and notebook tests, the solution notebooks, and a
# strict book build that executes every page from scratch (fresh cache in $(TEST_OUT)).
# A student edition (`minillm exercises student-edition`) has no solutions/ to run.
test: $(STAMP)
	scripts/ensure_chromium.sh
	rm -rf $(TEST_OUT)
	$(BIN)/jupyter-book build . --path-output $(TEST_OUT) $(JB_FLAGS)
	MINILLM_BOOK_HTML=$(TEST_OUT)/_build/html $(BIN)/python -m pytest tests -q
	if [ -d solutions ]; then $(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=600 \
		solutions -q -p no:cacheprovider; fi

exercises: $(STAMP)
	$(BIN)/minillm exercises release

notebooks: $(STAMP)
	$(BIN)/minillm notebooks

# JupyterLab with jupytext: book/*.md open as notebooks (a setting inside .venv only).
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
lab: $(STAMP)
	mkdir -p $(dir $(LAB_OVERRIDES))
	echo '{"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}}' > $(LAB_OVERRIDES)
	$(BIN)/jupyter lab

clean:
	rm -rf _build .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
