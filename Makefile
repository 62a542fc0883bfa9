# Developer entry points. `make test` is the command CI and the README use.
PYTHON ?= python3

.PHONY: all install test rootfs bench profile clean

all: install

# Editable install with the Inspect provider and the test tools.
install:
	$(PYTHON) -m pip install -e '.[inspect,test]'

# Fixture root filesystems for the tests (cached in rootfs/build/).
rootfs:
	rootfs/busybox.sh
	rootfs/debian.sh

# The whole suite, in every identity mode this machine offers (see tests/run.sh).
test:
	PYTHON=$(PYTHON) tests/run.sh

# The main table in every identity mode (see bench/run.sh), then the rest
# once, in this user's mode. BENCH_FULL=1: the heavy rows at full size
# (compose samples 100 at a time, 10,000 live sandboxes, an eval of 1000
# samples 500 at a time; see docs/benchmarks.md).
bench:
	PYTHON=$(PYTHON) bench/run.sh
	$(PYTHON) bench/provider.py --rows compose,live $(if $(BENCH_FULL),--full)
	$(PYTHON) bench/netmodes.py
	$(PYTHON) bench/net.py
	$(PYTHON) bench/eval.py --samples 200 --rounds 3
	$(PYTHON) bench/eval.py --wide $(if $(BENCH_FULL),,--samples 100 --concurrency 100 --rounds 2)

# Where the CPU of an exec, a sample's sandbox, a compose sample and a service network goes (docs/performance.md).
profile:
	$(PYTHON) bench/breakdown.py --top 25 --compose 20 --networks 20

clean:
	rm -rf build dist *.egg-info nsbox/_native*.so nsbox/_text*.so nsbox/_native.c nsbox/nsbox-init nsbox/nsbox-create nsbox/nsbox-tied rootfs/build
