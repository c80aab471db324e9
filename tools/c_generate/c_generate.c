/*
 * c_generate: greedy decoding of a loopcast artifact through the ONNX Runtime C API.
 *
 *   c_generate ARTIFACT_DIR MAX_NEW_TOKENS ID,ID,...
 *
 * Reads manifest.json (cJSON), opens the prefill and decode graphs, registers the custom-op
 * library when the manifest names one, allocates every KV slot once and binds it as both
 * past and present (GroupQueryAttention updates it in place), then prints the generated ids
 * comma-separated. Errors print one "error: ..." line and exit 2.
 *
 * Lengths contract (manifest kv_layout): M new rows at positions n..n+M-1 take
 * seqlens_k = n+M-1 (int32 [1]) and total_sequence_length = n+M (int32 scalar).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <onnxruntime_c_api.h>

static const OrtApi *ort;

static void die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("error: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    exit(2);
}

static void check(OrtStatus *status, const char *what) {
    if (status != NULL) {
        const char *msg = ort->GetErrorMessage(status);
        /* ORT messages can span lines; keep the first so the error stays one line. */
        char first[512];
        snprintf(first, sizeof first, "%s", msg);
        first[strcspn(first, "\n")] = '\0';
        ort->ReleaseStatus(status);
        die("%s: %s", what, first);
    }
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) die("%s: not found", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)size + 1);
    if (text == NULL || fread(text, 1, (size_t)size, f) != (size_t)size) die("%s: cannot read", path);
    text[size] = '\0';
    fclose(f);
    return text;
}

static const cJSON *field(const cJSON *obj, const char *name, const char *manifest) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (item == NULL) die("%s: corrupt manifest (missing field '%s')", manifest, name);
    return item;
}

static int int_field(const cJSON *obj, const char *name, const char *manifest) {
    const cJSON *item = field(obj, name, manifest);
    if (!cJSON_IsNumber(item)) die("%s: corrupt manifest (field '%s' is not a number)", manifest, name);
    return item->valueint;
}

typedef struct {
    int slots, kv_heads, max_length, head_dim, vocab;
    char prefill_path[4096], decode_path[4096], custom_ops[4096];
    int eos[8], n_eos;
} Manifest;

static void graph_path(const cJSON *graphs, const char *kind, const char *dir, const char *manifest,
                       char *out, size_t size) {
    const cJSON *graph = field(graphs, kind, manifest);
    const cJSON *file = field(graph, "file", manifest);
    if (!cJSON_IsString(file)) die("%s: corrupt manifest (graphs.%s.file)", manifest, kind);
    snprintf(out, size, "%s/%s", dir, file->valuestring);
    FILE *f = fopen(out, "rb");
    if (f == NULL) die("%s: graph file for '%s' is missing", out, kind);
    fclose(f);
}

static Manifest read_manifest(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    char *text = read_file(path);
    cJSON *root = cJSON_Parse(text);
    if (root == NULL || !cJSON_IsObject(root)) die("%s: corrupt manifest (not valid JSON)", path);
    Manifest m = {0};
    if (int_field(root, "schema_version", path) != 1)
        die("%s: manifest schema version %d, this program reads version 1", path,
            int_field(root, "schema_version", path));
    const cJSON *dtype = field(root, "dtype", path);
    if (!cJSON_IsString(dtype) || strcmp(dtype->valuestring, "fp32") != 0)
        die("%s: dtype %s is not supported here (fp32 artifacts only)", path,
            cJSON_IsString(dtype) ? dtype->valuestring : "?");
    m.max_length = int_field(root, "max_length", path);
    m.vocab = int_field(field(root, "model", path), "vocab_size", path);
    const cJSON *kv = field(root, "kv_layout", path);
    m.slots = int_field(kv, "slots", path);
    const cJSON *shape = field(kv, "shape", path);
    if (cJSON_GetArraySize(shape) != 4 || !cJSON_IsNumber(cJSON_GetArrayItem(shape, 1)) ||
        !cJSON_IsNumber(cJSON_GetArrayItem(shape, 3)))
        die("%s: corrupt manifest (kv_layout.shape)", path);
    m.kv_heads = cJSON_GetArrayItem(shape, 1)->valueint;
    m.head_dim = cJSON_GetArrayItem(shape, 3)->valueint;
    const cJSON *graphs = field(root, "graphs", path);
    graph_path(graphs, "prefill", dir, path, m.prefill_path, sizeof m.prefill_path);
    graph_path(graphs, "decode", dir, path, m.decode_path, sizeof m.decode_path);
    const cJSON *lib = cJSON_GetObjectItemCaseSensitive(root, "custom_op_library");
    if (cJSON_IsString(lib)) snprintf(m.custom_ops, sizeof m.custom_ops, "%s/%s", dir, lib->valuestring);
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(root, "eos_token_ids");
    const cJSON *id;
    cJSON_ArrayForEach(id, eos) {
        if (m.n_eos < 8) m.eos[m.n_eos++] = id->valueint;
    }
    cJSON_Delete(root);
    free(text);
    return m;
}

typedef struct {
    OrtSession *session;
    OrtIoBinding *binding;
} Graph;

static OrtValue *tensor(OrtMemoryInfo *mem, void *data, size_t bytes, const int64_t *shape, size_t rank,
                        ONNXTensorElementDataType type) {
    OrtValue *value = NULL;
    check(ort->CreateTensorWithDataAsOrtValue(mem, data, bytes, shape, rank, type, &value), "tensor");
    return value;
}

/* Bind every slot's K and V buffer as past and present of one graph. */
static void bind_kv(Graph *g, OrtValue **keys, OrtValue **values, int slots) {
    char name[64];
    for (int s = 0; s < slots; s++) {
        snprintf(name, sizeof name, "past_key.%d", s);
        check(ort->BindInput(g->binding, name, keys[s]), name);
        snprintf(name, sizeof name, "past_value.%d", s);
        check(ort->BindInput(g->binding, name, values[s]), name);
        snprintf(name, sizeof name, "present_key.%d", s);
        check(ort->BindOutput(g->binding, name, keys[s]), name);
        snprintf(name, sizeof name, "present_value.%d", s);
        check(ort->BindOutput(g->binding, name, values[s]), name);
    }
}

static int is_eos(const Manifest *m, int64_t token) {
    for (int i = 0; i < m->n_eos; i++)
        if (m->eos[i] == token) return 1;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s ARTIFACT_DIR MAX_NEW_TOKENS ID,ID,...\n", argv[0]);
        return 2;
    }
    ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
    if (ort == NULL) die("the ONNX Runtime library does not provide C API version %d", ORT_API_VERSION);
    Manifest m = read_manifest(argv[1]);
    char *end = NULL;
    long max_new = strtol(argv[2], &end, 10);
    if (*end != '\0' || max_new < 0) die("MAX_NEW_TOKENS must be an integer >= 0, got '%s'", argv[2]);

    /* prompt ids */
    int64_t *prompt = malloc(sizeof(int64_t) * (strlen(argv[3]) + 1));
    if (prompt == NULL) die("out of memory");
    int64_t n_prompt = 0;
    for (char *tok = strtok(argv[3], ","); tok != NULL; tok = strtok(NULL, ",")) {
        long id = strtol(tok, &end, 10);
        if (*end != '\0') die("prompt ids must be comma-separated integers, got '%s'", tok);
        if (id < 0 || id >= m.vocab) die("token id %ld is outside the vocabulary [0, %d)", id, m.vocab);
        prompt[n_prompt++] = id;
    }
    if (n_prompt == 0) die("prompt is empty: give at least one token");
    if (n_prompt > m.max_length) die("prompt of %lld tokens is longer than the max length %d",
                                     (long long)n_prompt, m.max_length);

    OrtEnv *env;
    check(ort->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "c_generate", &env), "CreateEnv");
    OrtSessionOptions *options;
    check(ort->CreateSessionOptions(&options), "CreateSessionOptions");
    check(ort->SetSessionGraphOptimizationLevel(options, ORT_ENABLE_ALL), "optimization level");
    check(ort->AddSessionConfigEntry(options, "session.intra_op.allow_spinning", "0"), "spinning");
    if (m.custom_ops[0] != '\0') check(ort->RegisterCustomOpsLibrary_V2(options, m.custom_ops), m.custom_ops);
    Graph prefill = {0}, decode = {0};
    check(ort->CreateSession(env, m.prefill_path, options, &prefill.session), m.prefill_path);
    check(ort->CreateSession(env, m.decode_path, options, &decode.session), m.decode_path);
    check(ort->CreateIoBinding(prefill.session, &prefill.binding), "binding");
    check(ort->CreateIoBinding(decode.session, &decode.binding), "binding");

    OrtMemoryInfo *mem;
    check(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &mem), "memory info");

    /* KV: one K and one V buffer per slot, allocated once, bound to both graphs. */
    const int64_t kv_shape[4] = {1, m.kv_heads, m.max_length, m.head_dim};
    size_t kv_floats = (size_t)m.kv_heads * m.max_length * m.head_dim;
    OrtValue **keys = calloc((size_t)m.slots, sizeof *keys), **values = calloc((size_t)m.slots, sizeof *values);
    float *kv_data = calloc(kv_floats * 2 * (size_t)m.slots, sizeof(float));
    if (kv_data == NULL) die("cannot allocate %zu bytes of KV", kv_floats * 2 * m.slots * sizeof(float));
    for (int s = 0; s < m.slots; s++) {
        keys[s] = tensor(mem, kv_data + (2 * s) * kv_floats, kv_floats * sizeof(float), kv_shape, 4,
                         ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
        values[s] = tensor(mem, kv_data + (2 * s + 1) * kv_floats, kv_floats * sizeof(float), kv_shape, 4,
                           ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    }
    bind_kv(&prefill, keys, values, m.slots);
    bind_kv(&decode, keys, values, m.slots);

    /* Step inputs and outputs: fixed buffers, bound once (prefill rebinds only its ids). */
    int64_t token_in[1], next_id[1];
    int32_t seqlens[1], total[1];
    float *logits = malloc(sizeof(float) * (size_t)m.vocab);
    if (logits == NULL || keys == NULL || values == NULL) die("out of memory");
    const int64_t one[1] = {1}, ids_shape[2] = {1, 1}, logits_shape[3] = {1, 1, m.vocab};
    OrtValue *seqlens_v = tensor(mem, seqlens, sizeof seqlens, one, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    OrtValue *total_v = tensor(mem, total, sizeof total, NULL, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    OrtValue *next_v = tensor(mem, next_id, sizeof next_id, ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    OrtValue *logits_v = tensor(mem, logits, sizeof(float) * (size_t)m.vocab, logits_shape, 3,
                                ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    OrtValue *token_v = tensor(mem, token_in, sizeof token_in, ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    const int64_t prompt_shape[2] = {1, n_prompt};
    OrtValue *prompt_v = tensor(mem, prompt, sizeof(int64_t) * (size_t)n_prompt, prompt_shape, 2,
                                ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    Graph *graphs[2] = {&prefill, &decode};
    for (int i = 0; i < 2; i++) {
        check(ort->BindInput(graphs[i]->binding, "seqlens_k", seqlens_v), "seqlens_k");
        check(ort->BindInput(graphs[i]->binding, "total_sequence_length", total_v), "total_sequence_length");
        check(ort->BindOutput(graphs[i]->binding, "next_token_ids_BS", next_v), "next_token_ids_BS");
        check(ort->BindOutput(graphs[i]->binding, "logits_BSV", logits_v), "logits_BSV");
    }
    check(ort->BindInput(prefill.binding, "input_ids_BS", prompt_v), "input_ids_BS");
    check(ort->BindInput(decode.binding, "input_ids_BS", token_v), "input_ids_BS");
    OrtRunOptions *run;
    check(ort->CreateRunOptions(&run), "run options");

    /* Greedy: prefill the prompt, then one decode step per token. n = committed KV length. */
    int64_t n = 0;
    long produced = 0;
    if (max_new > 0) {
        seqlens[0] = (int32_t)(n_prompt - 1);
        total[0] = (int32_t)n_prompt;
        check(ort->RunWithBinding(prefill.session, run, prefill.binding), "prefill");
        n = n_prompt;
        for (;;) {
            int64_t token = next_id[0];
            printf(produced ? ",%lld" : "%lld", (long long)token);
            produced++;
            if (is_eos(&m, token) || produced >= max_new || n >= m.max_length) break;
            token_in[0] = token;
            seqlens[0] = (int32_t)n;
            total[0] = (int32_t)(n + 1);
            check(ort->RunWithBinding(decode.session, run, decode.binding), "decode");
            n += 1;
        }
    }
    printf("\n");

    ort->ReleaseRunOptions(run);
    OrtValue *all[] = {seqlens_v, total_v, next_v, logits_v, token_v, prompt_v};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) ort->ReleaseValue(all[i]);
    for (int s = 0; s < m.slots; s++) {
        ort->ReleaseValue(keys[s]);
        ort->ReleaseValue(values[s]);
    }
    for (int i = 0; i < 2; i++) {
        ort->ReleaseIoBinding(graphs[i]->binding);
        ort->ReleaseSession(graphs[i]->session);
    }
    ort->ReleaseMemoryInfo(mem);
    ort->ReleaseSessionOptions(options);
    ort->ReleaseEnv(env);
    free(kv_data);
    free(keys);
    free(values);
    free(logits);
    free(prompt);
    return 0;
}
