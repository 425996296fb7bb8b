"""The files of the ``openvino`` format, named once for its writer, runner and plugin."""

XML_NAME = "model.xml"
BIN_NAME = "model.bin"
