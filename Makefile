# Two commands for a fresh machine: `make train` and `make test`.
# torch is pinned in the install step (2.13.0: the CPU build these machines carry).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: install install-dev train test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q $(TORCH_PIN) -e . tqdm
	touch $@

# dev: the test tools; eval: lm-evaluation-harness, which tests/hf drives as a real client.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q $(TORCH_PIN) -e ".[dev,eval]" tqdm
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

train: install
	$(PY) -m nsa.train --preset tiny --overwrite

test: install-dev
	$(PY) -m pytest -q

lint: install-dev
	$(VENV)/bin/ruff check nsa tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
