# `make test` and `make demo` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# A local directory of wheels (the CPU build of torch lives there on our machines); used when present.
WHEELS ?= /opt/wheels
FIND   := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)
STAMP  := $(VENV)/.gradq-installed

.PHONY: setup test demo clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the pins or the package metadata change.
$(STAMP): $(PY) requirements-pins.txt pyproject.toml
	$(PIP) install -q $(FIND) -c requirements-pins.txt torch
	$(PIP) install -q $(FIND) -c requirements-pins.txt -e '.[test,data,plots,ans,integrations]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=25; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

demo: setup
	$(VENV)/bin/gradq demo

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
