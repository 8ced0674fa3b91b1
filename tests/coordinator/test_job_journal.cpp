// The job journal and the job table over it: replay after a stop (queued jobs again, interrupted
// ones retried once or failed by policy, ended ones answerable), torn and corrupt tails, the
// compaction bound, and writes that fail (a file-size limit stands in for a full disk).
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "coordinator/service/job_journal.h"
#include "coordinator/service/job_table.h"

namespace xctx {
namespace {

namespace fs = std::filesystem;
using rpc::JobPhase;

rpc::Job generate_job(const std::string& prompt) {
  rpc::Job job;
  job.kind = rpc::JobKind::GENERATE;
  rpc::GenerateJob g;
  g.prompt = prompt;
  g.max_tokens = 4;
  job.__set_generate(g);
  return job;
}

rpc::JobResult done(const std::string& text) {
  rpc::JobResult r;
  r.phase = JobPhase::DONE;
  r.text = text;
  r.generated_tokens = 4;
  return r;
}

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("xctx-journal-" + std::to_string(::getpid()) + "-" +
                                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  temp_dir() { fs::remove_all(path); }
  ~temp_dir() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
  fs::path journal() const { return path / "jobs.journal"; }
};

// Jobs 1..3 accepted; 1 ran and ended; 2 was running when the service stopped; 3 was queued.
void first_life(const std::string& dir) {
  job_journal j(dir, 100);
  job_table t(8, 100, &j);
  for (const char* p : {"one", "two", "three"}) t.submit(generate_job(p));
  auto a = t.next(std::chrono::milliseconds(0));
  ASSERT_EQ(a->first, 1);
  t.finish(1, done("first"));
  auto b = t.next(std::chrono::milliseconds(0));
  ASSERT_EQ(b->first, 2);
  // ... and here the process dies: no finish, no close.
}

TEST(job_journal, a_restart_runs_what_was_owed_and_answers_what_ended) {
  temp_dir d;
  first_life(d.str());
  job_journal j(d.str(), 100);
  EXPECT_EQ(j.replayed().next_id, 4);
  ASSERT_EQ(j.replayed().jobs.size(), 2u);
  EXPECT_EQ(j.replayed().jobs[0].starts, 1);
  EXPECT_EQ(j.replayed().jobs[1].starts, 0);
  job_table t(8, 100, &j);
  EXPECT_EQ(t.result(1).text, "first");
  // The interrupted job first (it was first in line), then the queue; new ids continue.
  auto a = t.next(std::chrono::milliseconds(0));
  ASSERT_TRUE(a);
  EXPECT_EQ(a->first, 2);
  EXPECT_EQ(a->second.generate.prompt, "two");
  EXPECT_EQ(t.submit(generate_job("four")), 4);
  t.finish(2, done("second"));
  EXPECT_EQ(t.next(std::chrono::milliseconds(0))->first, 3);
}

TEST(job_journal, an_interrupted_job_is_retried_once_then_failed) {
  temp_dir d;
  first_life(d.str());
  {  // second life: job 2 starts again and the service dies again
    job_journal j(d.str(), 100);
    job_table t(8, 100, &j);
    ASSERT_EQ(t.next(std::chrono::milliseconds(0))->first, 2);
  }
  {
    job_journal j(d.str(), 100);
    job_table t(8, 100, &j);
    const rpc::JobStatus s = t.status(2);
    EXPECT_EQ(s.phase, JobPhase::FAILED);
    EXPECT_NE(s.error.find("interrupted"), std::string::npos) << s.error;
    EXPECT_NE(s.error.find("twice"), std::string::npos) << s.error;
    EXPECT_EQ(t.next(std::chrono::milliseconds(0))->first, 3);
  }
  // The failure is durable: a fourth life sees job 2 ended, not pending.
  job_journal j(d.str(), 100);
  ASSERT_EQ(j.replayed().jobs.size(), 1u);
  EXPECT_EQ(j.replayed().jobs[0].id, 3);
  EXPECT_EQ(j.replayed().ended.back().id, 2);
}

TEST(job_journal, the_fail_policy_fails_an_interrupted_job_at_once) {
  temp_dir d;
  first_life(d.str());
  job_journal j(d.str(), 100);
  job_table t(8, 100, &j, interrupted_policy::fail);
  EXPECT_EQ(t.status(2).phase, JobPhase::FAILED);
  EXPECT_NE(t.status(2).error.find("--on-interrupt fail"), std::string::npos) << t.status(2).error;
  EXPECT_EQ(t.result(2).phase, JobPhase::FAILED);
  EXPECT_EQ(t.next(std::chrono::milliseconds(0))->first, 3);
}

TEST(job_journal, queued_jobs_survive_a_clean_shutdown_and_the_job_it_stopped_runs_again) {
  temp_dir d;
  {
    job_journal j(d.str(), 100);
    job_table t(8, 100, &j);
    t.submit(generate_job("a"));
    t.submit(generate_job("b"));
    ASSERT_EQ(t.next(std::chrono::milliseconds(0))->first, 1);
    rpc::JobResult stopped;
    stopped.phase = JobPhase::CANCELLED;
    stopped.error = "the service is shutting down";
    t.finish(1, stopped, /*durable=*/false);
    t.close();
    EXPECT_EQ(t.status(2).phase, JobPhase::CANCELLED);  // in this life
  }
  job_journal j(d.str(), 100);
  job_table t(8, 100, &j);
  EXPECT_EQ(t.next(std::chrono::milliseconds(0))->first, 1);
  EXPECT_EQ(t.next(std::chrono::milliseconds(0))->first, 2);
}

TEST(job_journal, a_torn_tail_is_left_out_and_a_corrupt_record_kept_aside) {
  temp_dir d;
  first_life(d.str());
  const uintmax_t good = fs::file_size(d.journal());
  {
    std::ofstream f(d.journal(), std::ios::app | std::ios::binary);
    const std::string rec = journal_record(1, 9, std::string(40, 'x'));
    f.write(rec.data(), (std::streamsize)rec.size() / 2);  // a crash mid-write
  }
  {
    job_journal j(d.str(), 100);
    EXPECT_GT(j.replayed().torn_bytes, 0);
    EXPECT_EQ(j.replayed().jobs.size(), 2u);
    EXPECT_FALSE(fs::exists(d.str() + "/jobs.journal.corrupt-1"));
  }
  EXPECT_LE(fs::file_size(d.journal()), good);  // compacted without the torn record
  // A flipped byte inside the first record: nothing after it can be trusted.
  {
    std::fstream f(d.journal(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.put('\x7f');
  }
  job_journal j(d.str(), 100);
  EXPECT_GT(j.replayed().torn_bytes, 0);
  EXPECT_TRUE(fs::exists(d.str() + "/jobs.journal.corrupt-1"));
}

TEST(job_journal, compaction_keeps_the_file_bounded) {
  temp_dir d;
  {
    job_journal j(d.str(), 5);
    job_table t(4, 5, &j);
    for (int i = 0; i < 40; ++i) {
      const int64_t id = t.submit(generate_job(std::string(200, 'p')));
      t.next(std::chrono::milliseconds(0));
      t.finish(id, done(std::string(200, 't')));
    }
  }
  const uintmax_t before = fs::file_size(d.journal());
  job_journal j(d.str(), 5);
  EXPECT_EQ(j.replayed().ended.size(), 5u);
  EXPECT_EQ(j.replayed().ended.back().id, 40);
  EXPECT_EQ(j.replayed().next_id, 41);
  EXPECT_LT(fs::file_size(d.journal()) * 5, before);
}

// A file-size limit makes the journal's writes fail as a full disk does (EFBIG instead of ENOSPC).
struct file_size_limit {
  rlimit old{};
  explicit file_size_limit(uintmax_t bytes) {
    std::signal(SIGXFSZ, SIG_IGN);
    getrlimit(RLIMIT_FSIZE, &old);
    rlimit r = old;
    r.rlim_cur = (rlim_t)bytes;
    setrlimit(RLIMIT_FSIZE, &r);
  }
  ~file_size_limit() { setrlimit(RLIMIT_FSIZE, &old); }
};

TEST(job_journal, a_full_disk_accepts_nothing_and_loses_nothing) {
  temp_dir d;
  job_journal j(d.str(), 100);
  job_table t(8, 100, &j);
  t.submit(generate_job("small"));
  const uintmax_t size = fs::file_size(d.journal());
  {
    file_size_limit limit(size + 64);
    try {
      t.submit(generate_job(std::string(1000, 'x')));
      FAIL() << "accepted a job the journal could not hold";
    } catch (const rpc::RequestError& e) {
      EXPECT_EQ(e.code, rpc::ErrorCode::INTERNAL);
      EXPECT_NE(e.message.find("not accepted"), std::string::npos) << e.message;
      EXPECT_NE(e.message.find("jobs.journal"), std::string::npos) << e.message;
    }
    EXPECT_EQ(fs::file_size(d.journal()), size);  // the torn record was cut off again
  }
  EXPECT_EQ(t.submit(generate_job("after")), 2);  // room again: accepted, the id not skipped
  {
    // The end of a running job cannot be written: its result still answers from memory, and
    // new jobs are refused by name until the service is restarted.
    t.next(std::chrono::milliseconds(0));
    file_size_limit limit(fs::file_size(d.journal()) + 8);
    t.finish(1, done(std::string(500, 'r')));
    EXPECT_EQ(t.result(1).text, std::string(500, 'r'));
    try {
      t.submit(generate_job("more"));
      FAIL() << "accepted a job after the journal failed";
    } catch (const rpc::RequestError& e) {
      EXPECT_EQ(e.code, rpc::ErrorCode::INTERNAL);
      EXPECT_NE(e.message.find("cannot record jobs"), std::string::npos) << e.message;
    }
  }
  // What was written stays replayable: job 1 (started, its end lost) and job 2 pending.
  job_journal again(d.str(), 100);
  EXPECT_EQ(again.replayed().torn_bytes, 0);
  ASSERT_EQ(again.replayed().jobs.size(), 2u);
  EXPECT_EQ(again.replayed().jobs[0].id, 1);
  EXPECT_EQ(again.replayed().jobs[0].starts, 1);
}

TEST(job_journal, a_directory_that_cannot_be_made_is_named) {
  try {
    job_journal j("/proc/xctx-no-such-dir", 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--journal /proc/xctx-no-such-dir"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace xctx
