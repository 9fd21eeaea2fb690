// JobStateBytes: what the coordinator holds for one unfinished job, from its spec alone,
// so that a job is admitted only while the coordinator can hold it (JobRegistry's
// --jobs_memory_bytes). Per expert group (L x E of them, plus the dense one): its entry in
// the placement (store copies, compute owners) in the run and in each assignment being
// answered, its heat, each worker's report of the step in flight and the blobs written
// to it; per co-activated pair (layers of at most kMaxCoactivationExperts experts) its
// decayed weight. An upper bound: job_memory_test holds it against the allocator's in-use
// bytes of a real scheduler running such a job.
#ifndef PITH_SERVER_COORDINATOR_JOB_MEMORY_H_
#define PITH_SERVER_COORDINATOR_JOB_MEMORY_H_

#include <cstdint>

#include "pith/v1/spec.pb.h"

namespace pith::coordinator {

// The spec must be valid (ValidateJobSpec), with its defaults applied.
uint64_t JobStateBytes(const v1::JobSpec& spec);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_JOB_MEMORY_H_
