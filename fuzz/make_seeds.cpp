// Writes the seed corpora of the fuzz targets under fuzz/corpus/<target>/ from the project's own
// writers, so every seed is a valid input of today's formats:
//   build-fuzz/fuzz/fuzz_make_seeds fuzz/corpus
// Re-run it when a format changes; the hand-written seeds (text, JSON) sit next to these.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/calibration.h"
#include "common/error.h"
#include "coordinator/service/job_table.h"
#include "kernels/ops.h"
#include "model/gguf_writer.h"
#include "model/hparams.h"
#include "model/safetensors.h"
#include "registry/registry.h"
#include "snapshot_fixture.h"
#include "worker/cache_snapshot.h"

using namespace xctx;
namespace fs = std::filesystem;

namespace {

fs::path g_root;

void put(const std::string& target, const std::string& name, const std::vector<uint8_t>& bytes, int mode = -1) {
  fs::create_directories(g_root / target);
  std::ofstream out(g_root / target / name, std::ios::binary | std::ios::trunc);
  if (mode >= 0) out.put((char)mode);
  out.write(reinterpret_cast<const char*>(bytes.data()), (std::streamsize)bytes.size());
  std::printf("%s/%s: %zu bytes\n", target.c_str(), name.c_str(), bytes.size() + (mode >= 0));
}
void put(const std::string& target, const std::string& name, const std::string& text, int mode = -1) {
  put(target, name, std::vector<uint8_t>(text.begin(), text.end()), mode);
}
std::vector<uint8_t> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A BPE vocabulary small enough to spell "ab ab" with merges, plus a control token.
void add_vocab(gguf_writer& w, int n_vocab) {
  std::vector<std::string> tokens = {"<|endoftext|>", "<|im_start|>", "a", "b", "\xc4\xa0", "ab", "\xc4\xa0" "a"};
  while ((int)tokens.size() < n_vocab) tokens.push_back("t" + std::to_string(tokens.size()));
  tokens.resize((size_t)n_vocab);
  std::vector<int32_t> types(tokens.size(), 1);
  types[0] = types[1] = 3;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "smollm");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", {"a b", "\xc4\xa0 a"});
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 0);
}

void gguf_seeds() {
  // Every value type, nested arrays, and a tensor of each common type: the reader's surface.
  gguf_writer meta;
  meta.add("u8", gguf_make_u8(7));
  meta.add("i8", gguf_make_i8(-7));
  meta.add("u16", gguf_make_u16(700));
  meta.add("i16", gguf_make_i16(-700));
  meta.add_u32("u32", 70000);
  meta.add_i32("i32", -70000);
  meta.add_u64("u64", 1ull << 40);
  meta.add("i64", gguf_make_i64(-(1ll << 40)));
  meta.add_f32("f32", 0.5f);
  meta.add("f64", gguf_make_f64(-0.25));
  meta.add_bool("bool", true);
  meta.add_string("general.name", "seed");
  meta.add("nested", gguf_make_array(gguf_value_type::gguf_array,
                                     {gguf_make_array(gguf_value_type::gguf_u8, {gguf_make_u8(1), gguf_make_u8(2)})}));
  meta.add_f32_array("floats", {1.0f, 2.0f});
  const std::vector<float> row(32, 0.5f);
  meta.add_tensor_from_f32("t.f32", ggml_type::ggml_f32, {32}, row);
  meta.add_tensor_from_f32("t.q4_1", ggml_type::ggml_q4_1, {32}, row);
  meta.add_tensor_from_f32("t.q8_0", ggml_type::ggml_q8_0, {32}, row);
  put("gguf", "metadata_types.gguf", meta.to_bytes());

  // A complete (tiny) model with a tokenizer: hparams, vocabulary and weight checks all pass.
  model_hparams hp;
  hp.arch = "llama";
  hp.n_layer = 1, hp.n_embd = 8, hp.n_ff = 8, hp.n_head = 2, hp.n_head_kv = 1, hp.head_dim = 4, hp.n_rot = 4;
  hp.n_vocab = 8, hp.n_ctx_train = 64, hp.rms_eps = 1e-5f, hp.tied_output = true;
  gguf_writer model = make_tiny_model_writer(hp, ggml_type::ggml_f32, 1, false, ggml_type::ggml_f32);
  add_vocab(model, hp.n_vocab);
  put("gguf", "tiny_llama.gguf", model.to_bytes());

  gguf_writer v2(2);
  v2.set_alignment(64);
  v2.add_string("general.architecture", "qwen2");
  put("gguf", "v2_aligned.gguf", v2.to_bytes());
}

void safetensors_seeds(const fs::path& tmp) {
  // The tensors of the fixed config in fuzz_safetensors.cpp (n_embd 8, 2 heads of 4, 1 kv head,
  // n_ff 8, vocab 4, tied), in BF16, F16 and F32 so each conversion path has a seed.
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"model.embed_tokens.weight", {4, 8}},
      {"model.norm.weight", {8}},
      {"model.layers.0.input_layernorm.weight", {8}},
      {"model.layers.0.post_attention_layernorm.weight", {8}},
      {"model.layers.0.self_attn.q_proj.weight", {8, 8}},
      {"model.layers.0.self_attn.k_proj.weight", {4, 8}},
      {"model.layers.0.self_attn.v_proj.weight", {4, 8}},
      {"model.layers.0.self_attn.o_proj.weight", {8, 8}},
      {"model.layers.0.mlp.gate_proj.weight", {8, 8}},
      {"model.layers.0.mlp.up_proj.weight", {8, 8}},
      {"model.layers.0.mlp.down_proj.weight", {8, 8}}};
  for (const auto& [dtype, bytes] : std::vector<std::pair<std::string, size_t>>{{"BF16", 2}, {"F16", 2}, {"F32", 4}}) {
    std::vector<st_tensor_out> ts;
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<uint8_t> data((size_t)n * bytes);
      for (size_t i = 0; i < data.size(); ++i) data[i] = (uint8_t)((i * 37) % 61);  // small finite values
      if (bytes == 4)
        for (size_t i = 3; i < data.size(); i += 4) data[i] = 0x3c;
      else
        for (size_t i = 1; i < data.size(); i += 2) data[i] = 0x3c;
      ts.push_back({name, dtype, shape, data});
    }
    const fs::path p = tmp / ("tiny_" + dtype + ".safetensors");
    write_safetensors(p.string(), ts, {{"format", "pt"}});
    put("safetensors", p.filename().string(), slurp(p));
  }
  write_safetensors((tmp / "mixed.safetensors").string(),
                    {{"a", "I64", {2}, std::vector<uint8_t>(16, 1)}, {"b", "U8", {3}, {1, 2, 3}},
                     {"empty", "F32", {0, 4}, {}}});
  put("safetensors", "mixed_dtypes.safetensors", slurp(tmp / "mixed.safetensors"));
}

void hf_config_seeds() {
  put("hf_config", "llama.json", R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
 "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
 "rope_theta": 100000, "rope_scaling": null, "tie_word_embeddings": true, "hidden_act": "silu",
 "head_dim": 64, "attention_bias": false, "mlp_bias": false, "torch_dtype": "bfloat16"})");
  put("hf_config", "qwen2_linear_rope.json", R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "vocab_size": 100, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
 "rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": 4096, "use_sliding_window": false})");
  put("hf_config", "mistral_rope_parameters.json", R"({"model_type": "mistral", "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
 "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "head_dim": null,
 "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "sliding_window": 16})");
  put("hf_config", "bad_yarn.json", R"({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
 "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_scaling": {"rope_type": "yarn", "factor": 4}})");
}

void calibration_seeds(const fs::path& tmp) {
  calibration c;
  c.model_fingerprint = 0xfeed;
  c.model_name = "seed";
  c.n_layer = 1, c.n_head_kv = 1, c.head_dim = 2;
  c.text_source = "austen:emma", c.weighting = "attention-output";
  c.n_samples = 1, c.seq_len = 8, c.seed = 3;
  for (auto& setting : c.layers) {
    calib_layer_setting l;
    l.k_lo = {-1.0f, -2.0f}, l.k_hi = {1.0f, 2.0f};
    for (int b = 0; b < 3; ++b) {
      nuq_datatype t;
      const int m = 1 << kCalibBits[b];
      for (int i = 0; i < m; ++i) t.centroids.push_back(-1.0f + 2.0f * (float)i / (float)(m - 1));
      t.std_pre = 0.5, t.std_post = 0.6, t.mean_pre = 0.01, t.mean_post = -0.01;
      l.k[b] = t, l.v[b] = t;
    }
    setting.push_back(l);
  }
  const fs::path p = tmp / "seed.calib";
  save_calibration(c, p.string());
  const std::vector<uint8_t> bytes = slurp(p);
  put("calibration", "valid_fixed_checksum.bin", bytes, 1);  // mode 1: harness recomputes the checksum
  put("calibration", "valid_as_is.bin", bytes, 0);
}

void summarize_seeds() {
  put("summarize_jsonl", "two_docs.jsonl",
      "{\"id\": \"a\", \"text\": \"The cat sat on the mat.\"}\n{\"id\": \"b\", \"text\": \"The dog barked.\"}\n");
  put("summarize_jsonl", "fields.jsonl",
      "{\"id\": \"x\", \"path\": \"doc.txt\", \"instruction\": \"Summarize.\", \"max_tokens\": 64}\r\n\n"
      "{\"id\": \"y\", \"text\": \"\\u00e9t\\u00e9 \\ud83d\\ude00\", \"max_tokens\": 0}\n"
      "{\"id\": \"z\", \"text\": 5, \"path\": \"\"}\n");
  put("summarize_jsonl", "bad_line.jsonl", "{\"id\": \"a\", \"text\": \"ok\"}\n[1, 2]\n");
  put("summarize_jsonl", "duplicate_id.jsonl", "{\"id\": \"a\", \"text\": \"1\"}\n{\"id\": \"a\", \"text\": \"2\"}\n");
}

// The first byte picks the endpoint: 0 completions, 1 chat (fuzz_openai_request.cpp).
void openai_seeds() {
  const auto both = [](const std::string& name, int ep, const std::string& body) {
    put("openai_request", name, std::string(1, (char)ep) + body);
  };
  both("completion.json", 0, R"({"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})");
  both("completion_all.json", 0,
       R"({"prompt": ["x"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, )"
       R"("frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1, "repeat_last_n": 32, )"
       R"("no_repeat_ngram": 3, "seed": 7, "stop": ["\n\n", "END"], "stream": true, )"
       R"("stream_options": {"include_usage": true}, "n": 1, "logprobs": null, "echo": false})");
  both("completion_refused.json", 0, R"({"prompt": [1, 2], "n": 2, "logit_bias": {"1": 1}})");
  both("chat.json", 1,
       R"({"messages": [{"role": "developer", "content": "Be brief."}, )"
       R"({"role": "user", "content": [{"type": "text", "text": "Hi \u00e9\ud83d\ude00"}]}, )"
       R"({"role": "assistant", "content": "Hello."}], "max_completion_tokens": 9, "stream": true})");
  both("chat_refused.json", 1, R"({"messages": [{"role": "tool", "content": null}], "tools": [{}]})");
}

void thrift_seeds() {
  const auto save = [](const std::string& name, const rpc::Job& job) {
    const std::string b = serialize_job(job);
    put("thrift_job", name, b);
  };
  rpc::Job g;
  g.kind = rpc::JobKind::GENERATE;
  g.__set_generate(rpc::GenerateJob());
  g.generate.prompt = "The capital of France is";
  g.generate.chat = true;
  g.generate.system = "Be brief.";
  g.generate.max_tokens = 16;
  g.generate.temperature = 0.7, g.generate.top_p = 0.9, g.generate.seed = 5;
  save("generate.bin", g);
  rpc::Job p;
  p.kind = rpc::JobKind::PASSKEY;
  p.__set_passkey(rpc::PasskeyJob());
  p.passkey.context = 1024, p.passkey.trials = 2, p.passkey.depths = {0.0, 0.5, 1.0}, p.passkey.filler = "austen";
  save("passkey.bin", p);
  rpc::Job s;
  s.kind = rpc::JobKind::SUMMARIZE;
  s.__set_summarize(rpc::SummarizeJob());
  s.summarize.document.id = "d1", s.summarize.document.text = "A long text.", s.summarize.document.max_tokens = 32;
  s.summarize.document.instruction = "Summarize.";
  save("summarize.bin", s);
  rpc::Job b;
  b.kind = rpc::JobKind::BATCH;
  b.__set_batch(rpc::BatchJob());
  b.batch.jsonl = "{\"id\":\"a\",\"text\":\"x\",\"max_tokens\":8}\n{\"id\":\"b\",\"text\":\"y\"}\n";
  b.batch.max_tokens = 4;
  save("batch.bin", b);
}

void snapshot_seeds(const fs::path& tmp) {
  put("cache_snapshot", "manifest.json",
      R"({"version": 1, "model": "fuzz", "format": "fp16", "ranks": 2, "tokens": 9, "held_per_rank": [5, 4]})", 0);
  const auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = xctx_fuzz::snapshot_geometry();
  int k = 0;
  for (cache_format f : xctx_fuzz::kSnapshotFormats) {
    auto cache = make_cache(cache_spec(f), g, *be);
    const int n = 5;
    std::vector<float> kv((size_t)n * g.n_head_kv * g.head_dim), x((size_t)n * g.n_embd);
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = 0.1f * (float)((i * 7) % 13) - 0.6f;
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.05f * (float)((i * 5) % 11);
    std::vector<int32_t> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = i;
    layer_input in;
    in.x = x.data(), in.k = kv.data(), in.v = kv.data(), in.pos = pos.data(), in.n = n;
    for (int l = 0; l < g.n_layer; ++l) cache->append(l, in);
    snapshot_state st;
    st.next_position = n, st.held_per_rank = {n}, st.prefill = "exact", st.tokens = {1, 2, 3, 4, 5};
    const fs::path dir = tmp / ("snap" + std::to_string(k));
    write_cache_snapshot(dir.string(), xctx_fuzz::snapshot_identity_for(cache_format::cache_fp16), st, *cache);
    const std::vector<uint8_t> bytes = slurp(snapshot_file(dir.string(), 0, 1));
    // Mode: bit 0 = rank file, bit 1 = fix checksums, bits 2-3 = the format restored into.
    const std::string name = std::string(format_traits(f).name) + ".xsnap";
    put("cache_snapshot", name, bytes, 1 | 2 | (k << 2));
    ++k;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT (fuzz/corpus)\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  const fs::path tmp = fs::temp_directory_path() / ("xctx-seeds-" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  try {
    gguf_seeds();
    safetensors_seeds(tmp);
    hf_config_seeds();
    calibration_seeds(tmp);
    summarize_seeds();
    thrift_seeds();
    openai_seeds();
    snapshot_seeds(tmp);
  } catch (const Error& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    fs::remove_all(tmp);
    return 1;
  }
  fs::remove_all(tmp);
  return 0;
}
