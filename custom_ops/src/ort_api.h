// The ORT C++ API for every translation unit of the library. The API pointer is set once, by
// RegisterCustomOps (Ort::InitApi), never through OrtGetApiBase, which the library cannot link.
#pragma once

#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>
