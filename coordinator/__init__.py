"""The Ravnest coordinator: takes nodes in, groups them into clusters, plans jobs and tracks them.

`app.create_app(settings)` builds the FastAPI service; `cli.main` is `ravnest-coordinator`.
"""
