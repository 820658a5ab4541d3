"""Generated requests against every route of the collector's OpenAPI schema: whatever a client
sends is answered below 500 (issue 15, item 5).

Schemathesis draws valid and invalid parameters and bodies per operation (out-of-range steps, NUL
bytes, wrong types, huge integers); each request goes with the ingest, the read or the admin token
of the project that owns a run with data, or none, and about half of those naming a run name that
one, so the routes' real reads run, not only their 404. PostgreSQL: the backend that refuses what
SQLite lets through (NUL in text, integers beyond BIGINT).
"""

from __future__ import annotations

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from trainvitals.service import auth
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db
from trainvitals.service.store.models import Base

PER_OPERATION = 25  # 18 operations: about 450 requests a run, ~30 s

_RUN = "ra"


def test_no_generated_request_gets_a_5xx(pg_url: str) -> None:
    engine = db.make_engine(pg_url)
    with engine.begin() as conn:  # the session's database, emptied (db_url would also run SQLite)
        conn.execute(text("TRUNCATE " + ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables) + " CASCADE"))
    with db.make_sessionmaker(engine)() as session:
        tokens = {scope: auth.create_token(session, project="a", scope=scope) for scope in auth.SCOPES}
    engine.dispose()
    app = create_app(Settings(db=pg_url, run_analysis=False, settle_seconds=0, max_body_bytes=1 << 20))
    schema = schemathesis.openapi.from_dict(app.openapi())
    headers = {scope: {"Authorization": f"Bearer {t}"} for scope, t in tokens.items()}
    failures: list[str] = []
    with TestClient(app, raise_server_exceptions=False) as client:
        ingest = headers["ingest"]
        assert client.post("/v1/runs", json={"run": _RUN}, headers=ingest).status_code == 201
        steps = [{"kind": "step", "step": s, "ts": 1.0, "step_seconds": 0.25, "loss": 3.0} for s in range(20)]
        batch = {"run": _RUN, "rank": 0, "incarnation": 1, "seq": 0, "records": steps}
        assert client.post("/v1/batches", json=batch, headers=ingest).status_code == 200
        app.state.worker.run_once()  # reduced steps, so the reads have something to read

        def send(case: schemathesis.Case, who: str | None, ours: bool) -> None:
            if ours and case.method != "DELETE" and "run_id" in (case.path_parameters or {}):
                case.path_parameters["run_id"] = _RUN
            if ours and case.path == "/v1/batches" and isinstance(case.body, dict):
                case.body["run"] = _RUN
            kwargs = case.as_transport_kwargs(base_url="http://testserver")
            natural = "ingest" if case.path in ("/v1/runs", "/v1/batches") and case.method == "POST" else "read"
            scope = natural if who == "natural" else who
            response = client.request(
                kwargs["method"],
                kwargs["url"],
                params=kwargs.get("params"),
                headers={**kwargs.get("headers", {}), **(headers[scope] if scope else {})},
                json=kwargs.get("json"),
                content=kwargs.get("data") or kwargs.get("content"),
            )
            if response.status_code >= 500:
                failures.append(f"{response.status_code} {case.as_curl_command()}: {response.text[:300]}")

        for result in schema.get_all_operations():
            operation = result.ok()  # DELETE never names the run with data: the other cases read it
            cases = st.one_of(
                operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE),
                operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE),
            )
            # Hypothesis favours the first of each choice: the route's own token, the run with data.
            who = st.sampled_from(["natural", None, "ingest", "read", "admin"])
            limits = settings(
                max_examples=PER_OPERATION, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            limits(given(case=cases, who=who, ours=st.sampled_from([True, False]))(send))()
    assert not failures, "\n".join(failures[:10])


def test_every_integer_and_text_parameter_is_bounded(tmp_path) -> None:
    """What fuzzing rarely draws (an integer past BIGINT in an unbounded parameter) is ruled out by
    construction: every integer parameter of every route has both bounds, every text one a length
    limit and a pattern or an enum, so an out-of-range value is a 422 before a query runs."""
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'tv.db'}", auth=False, run_analysis=False))
    unbounded = []
    for path, operations in app.openapi()["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                for schema in parameter["schema"].get("anyOf", [parameter["schema"]]):
                    kind = schema.get("type")
                    bounded = (
                        {"minimum", "maximum"} <= schema.keys()
                        if kind == "integer"
                        else "enum" in schema or ("maxLength" in schema and "pattern" in schema)
                        if kind == "string"
                        else True
                    )
                    if not bounded:
                        unbounded.append(f"{method.upper()} {path} {parameter['name']}: {schema}")
    assert unbounded == []
