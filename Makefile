# Two entry points (README): `make demo` and `make test`. Each sets up .venv first.
# `make docs` builds the documentation site into site/ (broken links and missing pages fail it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test model docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar off -e '.[cpu,test]'
	@# The index's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and break
	@# transformers imports; vLLM's text models need none of them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	rm -f $(VENV)/.installed-* && touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/graphchunk-model smollm2

demo: model
	$(BIN)/graphchunk-serve-demo

test: model docs
	$(BIN)/python -m pytest --durations=30

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
