// Every method of the coordinator's and the stores' services has a rule in its server's
// policy table (a method missing would be refused to everyone: fail closed, but a bug),
// and the tables say what DESIGN says each role may do.
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/job_service.h"
#include "server/store/store_service.h"

namespace pith {
namespace {

using security::Role;

const google::protobuf::ServiceDescriptor* Service(const std::string& name) {
  const auto* service = google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
  EXPECT_NE(service, nullptr) << name;
  return service;
}

void ExpectEveryMethodRuled(const google::protobuf::ServiceDescriptor* service,
                            const security::Policy& policy) {
  ASSERT_NE(service, nullptr);
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string& method = service->method(i)->name();
    auto rule = policy.rules().find(method);
    ASSERT_NE(rule, policy.rules().end()) << service->name() << "." << method << " has no rule";
    EXPECT_FALSE(rule->second.empty()) << method;
  }
  EXPECT_EQ(policy.rules().size(), static_cast<size_t>(service->method_count()))
      << service->name() << ": a rule names no method";
}

TEST(ServicePolicyTest, EveryMethodHasARule) {
  ExpectEveryMethodRuled(Service("pith.v1.CoordinatorService"),
                         coordinator::CoordinatorServiceImpl::CoordinatorPolicy(true));
  ExpectEveryMethodRuled(Service("pith.v1.JobService"),
                         coordinator::JobServiceImpl::JobPolicy(true));
  ExpectEveryMethodRuled(Service("pith.v1.StoreService"),
                         store::StoreServiceImpl::StorePolicy(true));
}

TEST(ServicePolicyTest, RolesDoWhatTheyAreFor) {
  const auto members = coordinator::CoordinatorServiceImpl::CoordinatorPolicy(true).rules();
  const auto jobs = coordinator::JobServiceImpl::JobPolicy(true).rules();
  const auto stores = store::StoreServiceImpl::StorePolicy(true).rules();
  EXPECT_EQ(members.at("Register"), std::set<Role>{Role::kMember});
  EXPECT_EQ(members.at("DrainStore"), std::set<Role>{Role::kAdmin});
  EXPECT_EQ(jobs.at("SubmitJob"), (std::set<Role>{Role::kAdmin, Role::kUser}));
  for (const char* control : {"PrepareStep", "CommitStep", "AbortStep", "DeleteBlob", "DeleteJob",
                              "Checkpoint", "PullBlobs"}) {
    EXPECT_EQ(stores.at(control), std::set<Role>{Role::kCoordinator}) << control;
  }
}

}  // namespace
}  // namespace pith
