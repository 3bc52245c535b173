"""Drives the IBM emulator with IBM's own Python SDKs (ibm-vpc, ibm-platform-services,
ibm-cloud-sdk-core) and parses every answer with the SDK's models, so the emulator's wire shapes
stay IBM's.

Usage: python ibm_emulator_sdk.py VPC_URL IAM_URL API_KEY. Prints one JSON line of facts; any
SDK or model error is an exception (non-zero exit)."""
import json
import sys
import time

from ibm_cloud_sdk_core import ApiException, get_query_param
from ibm_cloud_sdk_core.authenticators import IAMAuthenticator
from ibm_platform_services import GlobalTaggingV1
from ibm_platform_services.global_tagging_v1 import Resource, TagList, TagResults
from ibm_vpc import VpcV1
from ibm_vpc.vpc_v1 import (
    Instance,
    InstanceCollection,
    InstancePrototypeInstanceByImageInstanceByImageInstanceByNetworkAttachment as ByImage,
    InstancesPager,
    KeyCollection,
    SubnetCollection,
    VPCCollection,
)

vpc_url, iam_url, api_key = sys.argv[1:4]
facts = {}

auth = IAMAuthenticator(api_key, url=iam_url)
svc = VpcV1(authenticator=auth)
svc.set_service_url(vpc_url)

vpcs = VPCCollection.from_dict(svc.list_vpcs().get_result())
vpc = vpcs.vpcs[0]
subnet = SubnetCollection.from_dict(svc.list_subnets().get_result()).subnets[0]
key = KeyCollection.from_dict(svc.list_keys().get_result()).keys[0]
facts["vpc"] = vpc.name
facts["subnet"] = subnet.name
facts["key"] = key.name

# The request the ibmz provider sends (Go's shape): a network attachment on the VPC's default
# security group, a general-purpose boot volume deleted with the instance, host_failure stop.
# The instance prototype has no user_tags (ibm-vpc 0.36 models): instance tags go through the
# Global Tagging API below.
names = []
for i in range(5):
    name = "sdk-s390x-%016xx" % i
    proto = {
        "name": name,
        "zone": {"name": "us-east-1"},
        "resource_group": {"id": vpc.resource_group.id},
        "vpc": {"id": vpc.id},
        "image": {"id": "r014-00000000-0000-4000-8000-000000000001"},
        "profile": {"name": "bz2-1x4"},
        "keys": [{"id": key.id}],
        "availability_policy": {"host_failure": "stop"},
        "boot_volume_attachment": {
            "delete_volume_on_instance_delete": True,
            "volume": {"name": name + "-boot", "capacity": 100, "profile": {"name": "general-purpose"}, "user_tags": ["mpc-cluster:sdk"]},
        },
        "primary_network_attachment": {
            "name": "eth0",
            "virtual_network_interface": {
                "auto_delete": True,
                "subnet": {"id": subnet.id},
                "security_groups": [{"id": vpc.default_security_group.id}],
            },
        },
    }
    ByImage.from_dict(proto)  # the SDK's own model accepts the request
    created = Instance.from_dict(svc.create_instance(proto).get_result())
    names.append(created.name)
facts["created"] = len(names)
facts["first_status"] = created.status

# Pagination: two instances per page, followed through next.href by the SDK's pager.
pages = 0
seen = []
start = None
while True:
    page = svc.list_instances(limit=2, start=start).get_result()
    coll = InstanceCollection.from_dict(page)
    pages += 1
    seen += [i.name for i in coll.instances]
    if coll.next is None:
        break
    start = get_query_param(coll.next.href, "start")
facts["pages"] = pages
facts["listed"] = sorted(seen) == sorted(names)
pager = InstancesPager(client=svc, limit=2)
facts["pager"] = len(pager.get_all())

time.sleep(0.5)
one = Instance.from_dict(svc.get_instance(created.id).get_result())
facts["booted_status"] = one.status
facts["address"] = one.primary_network_attachment.primary_ip.address

# User tags on an instance's CRN, as the provider keeps ownership: attach, list, detach.
tagging = GlobalTaggingV1(authenticator=auth)
tagging.set_service_url(iam_url)
res = TagResults.from_dict(tagging.attach_tag(
    resources=[Resource(resource_id=created.crn)],
    tag_names=["multi-platform-cluster:sdk", "taskRunID:tenant:build-1"],
    tag_type="user").get_result())
facts["attach_errors"] = [r.is_error for r in res.results]
listed_tags = TagList.from_dict(tagging.list_tags(attached_to=created.crn, tag_type="user").get_result())
facts["tags"] = sorted(t.name for t in listed_tags.items)
TagResults.from_dict(tagging.detach_tag(
    resources=[Resource(resource_id=created.crn)],
    tag_names=["taskRunID:tenant:build-1"], tag_type="user").get_result())
facts["tags_after_detach"] = sorted(
    t.name for t in TagList.from_dict(tagging.list_tags(attached_to=created.crn, tag_type="user").get_result()).items)

for i in InstanceCollection.from_dict(svc.list_instances(limit=100).get_result()).instances:
    svc.delete_instance(i.id)
deleting = Instance.from_dict(svc.get_instance(created.id).get_result())
facts["deleting_status"] = deleting.status
time.sleep(0.5)
try:
    svc.get_instance(created.id)
    facts["gone"] = False
except ApiException as e:
    facts["gone"] = e.code == 404
facts["left"] = len(InstanceCollection.from_dict(svc.list_instances().get_result()).instances)
print(json.dumps(facts))
