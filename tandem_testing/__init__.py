"""What the tests and the benchmarks both need: local cells started as real ``tandem serve``
processes (and the endpoint picker in the test's own process), free ports, images, scripted worker
steps and the soak workload.

No production module imports this package (tests/test_import_rules.py checks it).
"""
