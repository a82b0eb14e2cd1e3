# Each target creates .venv and installs the pinned requirements on first use.
#   make demo   run the whole series on the tiny preset into runs/run_<n>_<device>_x<count>/ and print the table
#   make test   run the test suite (the command CI runs)
#   make test-fast  the tests not marked slow (no notebook, no training run): about a minute, while you work
#   make lab    open the notebooks in JupyterLab
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast lab install clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and alone: nothing installed after it may replace it with a newer build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	# the course, and three extras: TensorBoard (the tests read the event files of --report-to tensorboard back),
	# DeepSpeed (lesson 10 runs its ZeRO-2 and 3 beside FSDP2's) and py-spy (lesson 14 dumps a hung rank's stacks)
	$(PY) -m pip install --quiet -e ".[tensorboard,deepspeed,diagnose]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

demo: install
	$(PY) -m my_utils demo

test: install
	$(PY) -m pytest -n 2 --dist loadgroup  # two workers share the cores, each taking the next test as it is free

test-fast: install
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow"

# Jupyter refuses to start as root (in a container, say) unless told it is meant.
lab: install
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

clean-venv:
	rm -rf $(VENV)
