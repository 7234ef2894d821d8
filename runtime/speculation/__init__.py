"""Speculation: proposers (draft, n-gram lookup), policies choosing what to verify, exact sampling."""
