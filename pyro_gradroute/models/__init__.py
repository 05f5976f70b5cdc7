"""Bundled models (with embedded or scikit-learn-bundled data) for examples, benchmarks and the CLI."""
