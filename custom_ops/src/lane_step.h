// LaneStep: the pipeline's lane schedule between two cycles of one unrolled cycle run
// (graphs/kinds.py::build_cycle_run, docs/architecture.md §5 "Pipeline cycle"), so K cycles run
// in one session call with no host round trip between them. The rule is ort_runtime/pipeline.py's
// greedy lane scheduler, row for row; the host checks every call's log against it.
//
// Inputs   0 state [2R+2] int32    positions of the lanes in rows 0..R-1 (row = loops run; -1: none),
//                                  their tokens, the last position a lane may take (limit), and
//                                  the exit depth (1..R-1: the loop whose head drafts)
//          1 ids [1, R] int64      the cycle's argmax per row
// Outputs  0 state_out [2R+2]      the lanes after this cycle (the next cycle's state)
//          1 positions [R] int32   state_out's positions (the next cycle's RowAttention rows)
//          2 entering [1, 1] int32 the token of the lane entering loop 0 next cycle (0: none)
//          3 record [2R+8] int32   what this cycle did: positions[R], ids[R], entering token,
//                                  committed position (-1: none), committed token, full-depth
//                                  token, verified, accepted, discarded lanes, drafted
// An exit depth outside 1..R-1 reads as 1 (the host validates it: the device cannot fail a call).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define LOOPCAST_HD __host__ __device__
#else
#define LOOPCAST_HD
#endif

namespace loopcast {

constexpr int kLaneRecordExtra = 8;
constexpr int kLaneStepMaxRows = 64;

// One cycle's schedule. A lane in row R-1 finishes: its position is committed and ids[R-1] is
// the full-depth token for the next position. Its successor (the next lane down) survives only
// if its token equals that; otherwise every younger lane is discarded and the token starts a
// new lane in row 0 (so does a finishing lane without successor). Else the lanes move down a
// row, and the youngest lane, if it just finished the exit loop, spawns the next position with
// its exit head's argmax. No lane is placed past ``limit``.
LOOPCAST_HD inline void lane_step(const int32_t* state, const int64_t* ids, int R, int32_t* out, int32_t* positions,
                                  int32_t* entering, int32_t* record) {
  const int32_t* pos = state;
  const int32_t* tok = state + R;
  const int32_t limit = state[2 * R];
  const int exit_depth = state[2 * R + 1] >= 1 && state[2 * R + 1] < R ? state[2 * R + 1] : 1;
  int32_t* rec_ids = record + R;
  int32_t* rec = record + 2 * R;
  for (int r = 0; r < R; ++r) {
    record[r] = pos[r];
    rec_ids[r] = static_cast<int32_t>(ids[r]);
  }
  rec[0] = pos[0] >= 0 ? tok[0] : 0;
  rec[1] = -1;
  for (int k = 2; k < kLaneRecordExtra; ++k) rec[k] = 0;
  int32_t next_pos[kLaneStepMaxRows], next_tok[kLaneStepMaxRows];
  for (int r = 0; r < R; ++r) {
    next_pos[r] = -1;
    next_tok[r] = 0;
  }
  bool restart = false;
  int32_t spawn_at = -1, spawn_token = 0;
  if (pos[R - 1] >= 0) {
    const int32_t target = static_cast<int32_t>(ids[R - 1]);
    int succ = -1;
    for (int r = R - 2; r >= 0 && succ < 0; --r)
      if (pos[r] >= 0) succ = r;
    const bool kept = succ >= 0 && tok[succ] == target;
    rec[1] = pos[R - 1];
    rec[2] = tok[R - 1];
    rec[3] = target;
    rec[4] = succ >= 0 ? 1 : 0;
    rec[5] = kept ? 1 : 0;
    if (!kept) {
      restart = true;
      for (int r = 0; r < R - 1; ++r) rec[6] += pos[r] >= 0 ? 1 : 0;
      spawn_at = pos[R - 1] + 1;
      spawn_token = target;
    }
  }
  if (!restart) {
    for (int r = 0; r + 1 < R; ++r) {
      next_pos[r + 1] = pos[r];
      next_tok[r + 1] = tok[r];
    }
    bool youngest = pos[exit_depth - 1] >= 0;
    for (int r = 0; r < exit_depth - 1; ++r) youngest = youngest && pos[r] < 0;
    if (youngest) {
      spawn_at = pos[exit_depth - 1] + 1;
      spawn_token = static_cast<int32_t>(ids[exit_depth - 1]);
    }
  }
  if (spawn_at >= 0 && spawn_at <= limit) {
    next_pos[0] = spawn_at;
    next_tok[0] = spawn_token;
    rec[7] = restart ? 0 : 1;
  }
  for (int r = 0; r < R; ++r) {
    out[r] = next_pos[r];
    out[R + r] = next_tok[r];
    positions[r] = next_pos[r];
  }
  out[2 * R] = limit;
  out[2 * R + 1] = exit_depth;
  *entering = next_tok[0];
}

}  // namespace loopcast
