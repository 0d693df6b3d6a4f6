"""Shared utilities every layer may import (configuration, logging); imports no other package of ours."""
