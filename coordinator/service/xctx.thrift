// The xctx coordinator service: rank 0 of `mpirun -np P xctx serve` answers these calls; every
// rank runs the queued jobs one at a time over the sequence-parallel cache (docs/service.md).
// Every call carries the shared secret (`auth`, empty when the service runs without
// --token-file) and every refusal is a RequestError naming the problem.

namespace cpp xctx.rpc
namespace py xctx_rpc

enum JobKind {
  GENERATE = 1,   // continue a prompt
  PASSKEY = 2,    // passkey retrieval trials
  SUMMARIZE = 3,  // one document
  BATCH = 4,      // many documents (JSONL lines, as `xctx summarize --in` reads them)
}

enum JobPhase {
  QUEUED = 1,
  PREFILL = 2,    // reading the prompt into the cache
  DECODE = 3,     // generating
  DONE = 4,
  FAILED = 5,
  CANCELLED = 6,
}

enum ErrorCode {
  BAD_REQUEST = 1,    // a field is missing or out of range; the message names it
  UNAUTHORIZED = 2,   // wrong or missing shared secret
  NOT_FOUND = 3,      // no job with that id
  TOO_LARGE = 4,      // request bytes, context tokens or output tokens over the service's limits
  QUEUE_FULL = 5,     // --max-queue jobs are waiting already
  NOT_FINISHED = 6,   // result() of a job that is still queued or running
  SHUTTING_DOWN = 7,  // the service is stopping and takes no new jobs
  INTERNAL = 8,       // the service could not record the job (its --journal cannot be written)
}

exception RequestError {
  1: ErrorCode code,
  2: string message,
}

struct ChatMessage {
  1: string role,
  2: string content,
}
struct GenerateJob {
  1: string prompt,
  2: bool chat = false,          // wrap the prompt in the model's chat template
  3: string system = "",         // chat system message
  4: i32 max_tokens = 128,
  5: double temperature = 0.0,   // 0: greedy
  6: double top_p = 1.0,
  7: i64 seed = 0,
  // The sampler's other processors (coordinator/jobs/sampler.h), neutral by default.
  8: i32 top_k = 0,
  9: double min_p = 0.0,
  10: double repetition_penalty = 1.0,
  11: i32 repeat_last_n = 64,
  12: double frequency_penalty = 0.0,
  13: double presence_penalty = 0.0,
  14: i32 no_repeat_ngram = 0,
  // Generation ends before any of these strings; the text holds none of it (OpenAI's `stop`).
  15: list<string> stop = [],
  // chat with a whole conversation (roles system | user | assistant), instead of system + prompt.
  16: list<ChatMessage> messages = [],
}

struct PasskeyJob {
  1: i64 context = 4096,         // prompt tokens
  2: i32 trials = 1,             // per depth
  3: list<double> depths = [0.0, 0.5, 1.0],
  4: i64 seed = 1,
  5: string filler = "classic",  // classic | austen
}

struct Document {
  1: string id,
  2: string text,
  3: string instruction = "",    // empty: the service's default summary instruction
  4: i32 max_tokens = 0,         // 0: the job's default
}

struct SummarizeJob {
  1: Document document,
}

struct BatchJob {
  // JSONL: one {"id", "text", optional "instruction", "max_tokens"} object per line. Lines
  // naming a "path" are refused over the service (the server's files are not the client's).
  1: string jsonl,
  2: i32 max_tokens = 0,         // default per document; 0: the service's default
}

struct Job {
  1: JobKind kind,
  2: optional GenerateJob generate,
  3: optional PasskeyJob passkey,
  4: optional SummarizeJob summarize,
  5: optional BatchJob batch,
}

struct JobStatus {
  1: i64 id,
  2: JobKind kind,
  3: JobPhase phase,
  4: i64 tokens_done,       // prompt tokens read + tokens generated so far
  5: i64 tokens_total,      // the same when the job ends at its output limits (an upper bound)
  6: double tokens_per_s,   // since the job started
  7: double eta_s,          // -1 while unknown
  8: i32 queue_position,    // 0 when running or ended; k: k-th job in line
  9: i32 items_done,        // documents (batch) or trials (passkey) finished
  10: i32 items_total,
  11: string error,        // FAILED: what went wrong
  12: double elapsed_s,     // since the job started running (0 while queued)
}

struct JobResult {
  1: i64 id,
  2: JobPhase phase,        // DONE, FAILED or CANCELLED
  3: string text,           // generate: the continuation; summarize: the summary;
                            // batch: the output JSONL; passkey: the per-depth table
  4: string json,           // details as one JSON object (timings, per-document lines, trials)
  5: string error,
  6: i64 prompt_tokens,
  7: i64 generated_tokens,
  8: double prefill_s,
  9: double decode_s,
  10: string finish_reason,  // generate: "stop" (end of generation or a stop string) | "length"
}

struct ServiceInfo {
  1: string model,
  2: string cache,              // the format every job's cache uses
  3: list<string> cache_formats, // formats this build knows (a service serves one)
  4: i32 ranks,
  5: i64 max_context_tokens,    // prompt + output tokens of one sequence
  6: i32 max_output_tokens,
  7: i64 max_request_bytes,
  8: i32 max_queue,
  9: i64 cache_bytes_per_rank,  // allocated once at start, reused by every job
  10: string backend,
  11: string prefill,           // exact | star
  12: bool auth_required,
}

struct Metrics {
  1: double uptime_s,
  2: i64 submitted,
  3: i64 completed,
  4: i64 failed,
  5: i64 cancelled,
  6: i64 rejected,              // requests answered with a RequestError
  7: i32 queued,
  8: bool busy,
  9: i64 prompt_tokens,         // read by finished jobs
  10: i64 generated_tokens,
  11: double busy_s,            // time spent running jobs
}

service Xctx {
  i64 submit(1: string auth, 2: Job job) throws (1: RequestError error),
  JobStatus status(1: string auth, 2: i64 id) throws (1: RequestError error),
  JobResult result(1: string auth, 2: i64 id) throws (1: RequestError error),
  // true: the job was queued and is dropped, or running and stops at its next step boundary
  // (between decode steps, trials or documents); false: it had ended already.
  bool cancel(1: string auth, 2: i64 id) throws (1: RequestError error),
  ServiceInfo info(1: string auth) throws (1: RequestError error),
  Metrics metrics(1: string auth) throws (1: RequestError error),
}
