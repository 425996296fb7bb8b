"""Default settings of an export and of verify, in one light module (no numpy or TensorFlow), so
that the command line's defaults and help texts are the library's own."""

DEFAULT_OPSET = 17  # ONNX opset of model.onnx and model_deterministic.onnx
DEFAULT_ATOL = 1e-5  # parity tolerance: |actual - reference| <= atol + rtol * |reference|
DEFAULT_RTOL = 1e-5
DEFAULT_SAMPLES = 1000  # observations sampled for golden parity at export
DEFAULT_BATCH = 256  # rows per runtime call during parity
DEFAULT_EXPLORE_SAMPLES = 10_000  # exploration draws per runtime
DEFAULT_OBSERVATIONS = 4  # probe observations of exploration parity
DEFAULT_ALPHA = 1e-6  # false-failure rate of one format's family of exploration tests
EXPORT_SEED = 0  # seed of export's parity samples
VERIFY_SEED = 1  # seed of verify's fresh samples
DEFAULT_EXTERNAL_DATA_THRESHOLD = 1 << 30  # ONNX weight bytes above which they go to an external data file
TRITON_MAX_BATCH_SIZE = 256  # max_batch_size of a Triton model that batches
SERVE_HTTP_PORT, SERVE_GRPC_PORT = 8000, 8001  # `serve`: Triton's own defaults
DEFAULT_STEPS = 200  # consecutive steps of stepped parity (recurrent policies)
DEFAULT_SEQUENCES = 4  # independent sequences stepped in parallel
DEFAULT_RETURN_TOLERANCE = 0.05  # rollout: largest relative difference of a lossy format's mean return
DEFAULT_EPISODES = 10  # rollout episodes
DEFAULT_ROLLOUT_FORMATS = ("saved_model", "onnx")  # rollout: the reference and the format it checks
