"""Hardware qualification and the backend conformance kit.

One harness, two front ends: :mod:`.cases` holds every op's shape/dtype sweep and its tolerances;
``inferhal qualify`` (:mod:`.runner`) runs them against the reference with determinism, batch-invariance
and performance checks and writes a JSON + HTML report; ``pytest --inferhal-backend=NAME``
(:mod:`.pytest_plugin`) runs the same cases as a conformance test suite.
"""
