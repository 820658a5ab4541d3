"""Grafana dashboards as code (docs/dashboards.md).

`panels` holds the shared pieces, `fleet` and `run` build one dashboard each, and `generate`
writes them as dashboards/generated/<uid>.json (`trainvitals dashboards write`). They need the
`dashboards` extra (grafana-foundation-sdk), so nothing is imported here: the rest of
trainvitals imports without the SDK.
"""
