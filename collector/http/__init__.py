"""The collector's HTTP layer: the app, routes, auth, the status page and the read API."""
