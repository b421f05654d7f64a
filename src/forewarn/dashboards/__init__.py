"""Grafana dashboards as code, and pushing them to a Grafana instance.

Building needs the ``dashboards`` extra (grafana-foundation-sdk); pushing needs the
``grafana`` extra (grafana-client). The generated JSON is checked into ``dashboards/`` for
file provisioning (``deploy/grafana-provisioning.yml``).
"""
