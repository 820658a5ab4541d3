"""The collector's ingest half: decode and validate a request body (decode), hand batches to the
group-commit writer (batch_writer), or load a recorded stream (replay). Storing is store/batches."""
