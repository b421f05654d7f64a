"""Deploy files shipped in the wheel: the systemd units (``forewarn-agent.service``,
``forewarn-collector.service``), the documented config examples (``agent.toml``,
``collector.toml``) and example Prometheus, Alertmanager and Grafana configs.

``forewarn deploy install`` (:mod:`forewarn.deploy.cli`) puts a role's unit and config in
place; ``forewarn deploy print FILE`` shows any of them.
"""
