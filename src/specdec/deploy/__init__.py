"""specdec on a Ray Serve cluster: many replicas of the server behind one endpoint.

    replica.py   one replica: an engine and the same FastAPI app as `specdec serve` (no second copy
                 of the routes); start-up calibration and the drain come with the app's lifespan
    router.py    Ray Serve's request-router extension point: one API key's requests go to one replica
    metrics.py   one /metrics for the deployment: replicas push their series to a hub deployment,
                 which merges them, labelled `replica`
    proxy.py     middleware in Ray's HTTP proxy: a stream whose replica died ends with an error event
    app.py       the deployment (replicas, threads, autoscaling) from `specdec serve` flags or a Serve config
    cli.py       `specdec serve --ray`

Nothing here is imported by the single-process `specdec serve`; `ray[serve]` is an optional extra.
"""
