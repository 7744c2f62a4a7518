"""specdec on a Ray Serve cluster: many replicas of the server behind one endpoint.

    replica.py   one replica: an engine and the same FastAPI app as `specdec serve` (no second copy
                 of the routes); start-up calibration and the drain come with the app's lifespan
    router.py    Ray Serve's request-router extension point: requests sharing a long prompt start go
                 to one replica, else one API key's requests do
    prefix.py    digests of a prompt's start, for that routing (no Ray)
    metrics.py   one /metrics for the deployment: replicas push their series to a hub deployment,
                 which merges them, labelled `replica`
    proxy.py     middlewares in Ray's HTTP proxy: a stream whose replica died ends with an error event;
                 the prompt's digests go to the router in a header
    scale.py     its settings (replicas, threads, autoscaling, the cluster), no Ray: a configuration section
    app.py       the deployment from the configuration (`specdec serve --ray`'s, or a Serve config's args)
    cli.py       `specdec serve --ray`

Nothing here but prefix.py and scale.py (no Ray) is imported by the single-process `specdec serve`; `ray[serve]`
is an optional extra.
"""
