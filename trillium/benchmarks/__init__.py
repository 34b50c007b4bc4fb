"""Benchmarks shipped with the package (`trillium bench ...`, scripts in bench/)."""
