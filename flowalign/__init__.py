"""flowalign: align flow-matching text-to-image models with reward models."""

__version__ = "0.1.0"
