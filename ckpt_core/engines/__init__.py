"""Engine-facing requesters: HTTP transport, request_inference_to_update, the reference launchers' flow."""
