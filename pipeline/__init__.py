"""pairmine pipeline: configuration, the Ray wiring of the operators, the mining job and the CLI."""

__version__ = "0.1.0"
