# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: this exact version is a CPU wheel on the build machines' disk;
# any other pulls a multi-GB CUDA build. pyproject keeps the wide range.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Writes demo-out/ (original, proxy, run, seaweedfs): a rerun replaces those and keeps what you
# wrote there; `make clean` removes it all.
demo: $(STAMP)
	$(BIN)/python -m moe_proxy.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info demo-out

# The operator and transformer images, tagged as the chart's defaults, with OCI archives in
# dist/images/ (podman; docs/images.md). PYTHON_IMAGE, TORCH_INDEX_URL, TORCH_WHEELS: see
# docker/images.sh.
.PHONY: images
images:
	docker/images.sh
