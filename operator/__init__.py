"""Kopf operator for TandemService resources (import name ``tandem_operator``)."""
